"""The objectives' names: the one list the configuration validates against and the registry builds from.

Torch-free, so reading a configuration (every stage does) never imports torch; the classes of
:mod:`cloob_core.objectives.losses` take their ``name`` from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    class_name: str  # in cloob_core.objectives.losses
    poly_view: bool = False  # takes several image and text views per sample (train.image_views / text_views)
    learns: bool = False  # has parameters of its own that train (SigLIP's logit bias)


OBJECTIVES: dict[str, Entry] = {
    # the CLOOB paper's ablation grid
    "cloob": Entry("CLOOBLoss"),
    "clip": Entry("ClipLoss"),
    "infoloob": Entry("InfoLOOBLoss"),
    "infonce_hopfield": Entry("HopfieldInfoNCELoss"),
    # restricted negatives (Wu et al.)
    "clip_ring": Entry("ClipRingLoss"),
    "infoloob_ring": Entry("InfoLOOBRingLoss"),
    "cloob_ring": Entry("CLOOBRingLoss"),
    # poly-view (Shidani et al.)
    "pvc_geometric": Entry("GeometricPVCLoss", poly_view=True),
    "pvc_arithmetic": Entry("ArithmeticPVCLoss", poly_view=True),
    "multicrop": Entry("MultiCropLoss", poly_view=True),
    "suffstats": Entry("SufficientStatisticsLoss", poly_view=True),
    # the sigmoid loss (Zhai et al., SigLIP)
    "siglip": Entry("SigLipLoss", learns=True),
}
OBJECTIVE_NAMES = tuple(OBJECTIVES)
POLY_VIEW_OBJECTIVES = tuple(name for name, entry in OBJECTIVES.items() if entry.poly_view)


def unknown(name: str) -> str:
    return f"unknown objective {name!r}; choose one of {sorted(OBJECTIVES)}"
