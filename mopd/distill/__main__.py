import sys

from mopd import exitcodes
from mopd.distill.loop import main

try:
    main()
except (exitcodes.Unreachable, ValueError) as e:   # expected: one line and its documented code (mopd/exitcodes.py)
    sys.exit(exitcodes.report(e, "mopd.distill"))
