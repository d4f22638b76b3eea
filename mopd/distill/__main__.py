import sys

from core import exitcodes
from mopd.distill.loop import main

try:
    main()
except (exitcodes.Unreachable, ValueError) as e:   # expected: one line and its documented code (core/exitcodes.py)
    sys.exit(exitcodes.report(e, "mopd.distill"))
