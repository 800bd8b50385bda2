"""The header: model, device, dtype, parameters and memory in use; a progress bar while the model loads."""

from __future__ import annotations

import os

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Label, ProgressBar, Static


def memory_in_use() -> str:
    """Resident memory of this process (and CUDA memory when a GPU is used)."""
    parts = []
    try:
        with open("/proc/self/statm") as fh:
            rss = int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        parts.append(f"RSS {rss / 2**20:.0f} MiB")
    except (OSError, ValueError, IndexError):
        import resource

        parts.append(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        parts.append(f"GPU {torch.cuda.memory_allocated() / 2**20:.0f} MiB")
    return " · ".join(parts)


class ModelBar(Horizontal):
    DEFAULT_CSS = """
    ModelBar { dock: top; height: 1; background: $boost; }
    ModelBar > #brand { width: auto; padding: 0 1; background: $primary; color: $text; text-style: bold; }
    ModelBar > #info { width: 1fr; padding: 0 1; }
    ModelBar > #mem { width: auto; padding: 0 1; color: $text-muted; }
    ModelBar > ProgressBar { width: 34; }
    ModelBar.-loaded > ProgressBar { display: none; }
    """

    def compose(self) -> ComposeResult:
        yield Label("tqbench", id="brand")
        yield Label("starting ...", id="info")
        yield ProgressBar(total=None, show_eta=False, show_percentage=False, id="load-progress")
        yield Label("", id="mem")

    def on_mount(self) -> None:
        self.refresh_memory()
        self.set_interval(2.0, self.refresh_memory)

    def refresh_memory(self) -> None:
        self.query_one("#mem", Label).update(memory_in_use())

    def loading(self, message: str) -> None:
        self.remove_class("-loaded")
        self.query_one("#info", Label).update(f"loading: {message}")

    def loaded(self, engine) -> None:
        info = engine.loaded
        dtype = str(info.dtype).replace("torch.", "")
        self.query_one("#info", Label).update(
            f"[b]{info.name}[/b] │ {info.device} │ {dtype} │ {info.num_params / 1e6:.1f}M params │ "
            f"{info.threads} threads │ loaded in {info.load_seconds:.1f}s"
        )
        self.add_class("-loaded")
        self.refresh_memory()

    def failed(self, message: str) -> None:
        self.add_class("-loaded")
        self.query_one("#info", Label).update(f"[b red]model not loaded[/]: {message}")


class RunStrip(Static):
    """Running comparison figures under the two texts."""

    DEFAULT_CSS = """
    RunStrip { height: auto; min-height: 1; padding: 0 1; background: $boost; }
    """
