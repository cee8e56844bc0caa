"""Benchmarks: ``python -m vfio_cxl.bench NAME [args]`` (see __main__.SUBCOMMANDS)."""
