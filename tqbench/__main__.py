"""``python -m tqbench`` is the same as the ``tqbench`` command."""

from tqbench.cli import main

if __name__ == "__main__":
    main()
