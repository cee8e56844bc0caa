"""A vfio-user server toolkit (protocol side only, no particular device)."""
