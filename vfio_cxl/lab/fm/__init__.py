"""The fabric manager: one process per lab that owns its VMs and device servers.

``vfio-cxl vm up --detach`` starts it (:mod:`.launch`); every later command is
a request over the lab's control socket (:mod:`.protocol`, :mod:`.client`);
:mod:`.registry` lists running labs and :mod:`.cleanup` removes a lab whose
fabric manager is gone; :mod:`.cli` is the command line of it all (``vm up
--detach``, ``vm ls|ssh|down``, ``fm ...``).  The manager itself is in parts:
see :mod:`.manager`.  See docs/fabric-manager.md.
"""
