"""A user's package: its submodule ``my_pkg.sub`` is bound as ``MyApp.Py.MyPkg.Sub``."""
