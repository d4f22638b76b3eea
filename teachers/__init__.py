"""Teachers: resolving teacher references (`resolve`, `registry`), scoring the
student's tokens with them behind one protocol (`scoring`), and routing a batch's rows
to their teachers with teacher-corrected sampling (`routing`). Import the submodule you
need: the package itself loads nothing, so resolving a reference does not start torch."""
