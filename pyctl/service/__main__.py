"""`python -m pyctl.service`: the reference inference service (see cli.py)."""

from pyctl.cli.service import main

if __name__ == "__main__":
    main()
