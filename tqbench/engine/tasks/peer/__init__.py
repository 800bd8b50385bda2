"""Peers: another library's methods run on the suite's own samples, beside tqbench's (``tasks --peer kvpress``).

kvpress pins an older transformers, so it runs in its own environment (``make kvpress-env``) as a subprocess
(``kvpress_runner.py``, JSON in and out); tqbench never imports it.

- ``client``: find the peer's Python (``peer_python``, ``PeerMissingError``), build the request from a prepared
  suite (``build_request``), run it (``run_peer``)
- ``rows``: the peer's answers scored as the suite scores (``score_peer``), the side-by-side rows of every method
  (``side_by_side``), the kvpress leaderboard folders (``write_leaderboard``)
"""

from tqbench.engine.tasks.peer.client import (
    ENV_VAR,
    PEERS,
    PRESSES,
    PeerError,
    PeerMissingError,
    build_request,
    check_presses,
    check_ratios,
    peer_python,
    run_peer,
)
from tqbench.engine.tasks.peer.rows import (
    leaderboard_rows,
    references_of,
    score_peer,
    side_by_side,
    side_by_side_from_files,
    tqbench_samples,
    write_leaderboard,
)

__all__ = [
    "ENV_VAR",
    "PEERS",
    "PRESSES",
    "PeerError",
    "PeerMissingError",
    "build_request",
    "check_presses",
    "check_ratios",
    "leaderboard_rows",
    "references_of",
    "peer_python",
    "run_peer",
    "score_peer",
    "side_by_side",
    "side_by_side_from_files",
    "tqbench_samples",
    "write_leaderboard",
]
