"""Old import path of the scan: import from ``tqbench.engine.scan`` (this module goes once tui/ and tests/
have switched; tests/tui/test_scan_compare.py monkeypatches ``scan`` here and the Scan pane imports it here)."""

from tqbench.engine.scan import (  # noqa: F401
    DEFAULT_CODECS,
    capture_qkv,
    parse_thresholds,
    resolve_codecs,
    resolve_layers,
    scan,
)
