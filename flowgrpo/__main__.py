"""``python -m flowgrpo`` and ``accelerate launch -m flowgrpo train CONFIG``."""
from flowgrpo.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
