"""Many labs at once: a kernel x topology x backend x run matrix, run on Ray.

    spec.load(path)          the matrix file (TOML), checked strictly  -> Matrix
    spec.expand(matrix)      its cells, one job each, checked before anything starts -> [Job]
    engine.run(jobs, ...)    the jobs on a Ray cluster (local by default), retried on lost nodes
    report.*                 the table, merged JUnit, KCIDB JSON, --json

Each job is self-contained (:mod:`.job`): it names its recipe hashes (QEMU tree, guest image,
kernel), checks them on the node it lands on, and boots its lab with the lab's own lifecycle
in a child process, so a cancelled or lost job leaves no VM behind.  See ``docs/matrix.md``.

This package uses the lab (``vfio_cxl.lab``); nothing imports it but the command line.
Ray, junitparser and kcidb-io are the optional extra ``matrix``.
"""
