"""calibrate: fit calibrated key transforms (``pcaq`` codecs) on captured K/Q of shipped calibration texts.

- ``transforms``: ``fit_transforms`` (engine + texts -> ``CalibratedTransforms``), ``fit_from_layers`` (captured
  layers -> the same, no model), ``calibration_texts`` / ``text_ids`` (the shipped mix and held-out texts).
"""

from tqbench.engine.calibrate.transforms import (
    CALIBRATION_DIR,
    DEFAULT_MIX,
    HELDOUT_DIR,
    calibration_texts,
    fit_from_layers,
    fit_transforms,
    save_beside,
    text_path,
)

__all__ = [
    "CALIBRATION_DIR",
    "DEFAULT_MIX",
    "HELDOUT_DIR",
    "calibration_texts",
    "fit_from_layers",
    "fit_transforms",
    "save_beside",
    "text_path",
]
