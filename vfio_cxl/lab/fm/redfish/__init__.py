"""The lab's fabric as a DMTF Redfish service (``vfio-cxl fm redfish``; docs/redfish.md).

A separate process that the fabric manager starts and owns, and a client of it: it reads
``status`` and follows ``events`` over the FM's control socket and moves GPUs with ``assign``
and ``release``; it holds no state of the lab's own.  ``model`` builds the resources,
``app`` serves them (Flask), ``events`` delivers the EventService's events, ``process`` is
the FM's side (start, stop)."""
