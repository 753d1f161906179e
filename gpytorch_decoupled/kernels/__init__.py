"""kernels of gpytorch_decoupled (populated by the method families as they land)."""

__all__: list[str] = []
