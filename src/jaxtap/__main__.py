"""``python -m jaxtap [options] script.py [args]``: see ``jaxtap._cli``."""
from jaxtap._cli import main

if __name__ == "__main__":
    raise SystemExit(main())
