#!/usr/bin/env python3
"""Numerical building blocks shared by the method families: float64 Cholesky with jitter, triangular solves, congruence
transforms, tiled kernel-vector products and quadratic forms, the sampled estimates of a mean basis's quadratic form and
the KL divergence from a whitened prior."""

from ._squared_distance_quadratic_form import squared_distance_quadratic_form
from .cholesky import jittered_cholesky, reset_jitter_warnings
from .congruence import congruence
from .cpu_memory import keep_freed_cpu_memory
from .diagonal import add_to_diagonal, identity_like
from .finite import all_finite
from .kernel_matvec import kernel_matvec
from .kernel_quadratic_form import kernel_quadratic_form
from .landmark_quadratic_form import (
    coefficient_proportional_rows,
    data_landmark_residual,
    landmark_blocks,
    landmark_controlled_estimate,
    landmark_quadratic_form,
)
from .lean_kernel import LeanKernel
from .log_normal_cdf import log_normal_cdf
from .psd_roots import positive_part_root, pseudo_inverse_root
from .quadratic_form import column_sampled_quadratic_form
from .settings import kernel_keep_size, kernel_tile_size
from .shapes import broadcast_shapes
from .subnormal_floor import exponent_floor, floored_exp
from .thin_cross_product import thin_cross_product
from .triangular import (
    cholesky_logdet,
    cholesky_solve,
    solve_lower,
    solve_lower_transpose,
    symmetrized,
    weighted_gram,
)
from .whitened_kl import whitened_kl

__all__ = [
    "LeanKernel",
    "log_normal_cdf",
    "add_to_diagonal",
    "all_finite",
    "broadcast_shapes",
    "cholesky_logdet",
    "cholesky_solve",
    "coefficient_proportional_rows",
    "column_sampled_quadratic_form",
    "congruence",
    "data_landmark_residual",
    "exponent_floor",
    "floored_exp",
    "identity_like",
    "jittered_cholesky",
    "keep_freed_cpu_memory",
    "kernel_keep_size",
    "kernel_matvec",
    "kernel_quadratic_form",
    "kernel_tile_size",
    "landmark_blocks",
    "landmark_controlled_estimate",
    "landmark_quadratic_form",
    "positive_part_root",
    "pseudo_inverse_root",
    "reset_jitter_warnings",
    "solve_lower",
    "solve_lower_transpose",
    "squared_distance_quadratic_form",
    "symmetrized",
    "thin_cross_product",
    "weighted_gram",
    "whitened_kl",
]
