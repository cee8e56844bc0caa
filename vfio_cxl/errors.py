"""One exception type for problems the user can fix.

Every message names what was wrong and what to do about it; the CLI prints it
as a single line and exits non-zero instead of dumping a traceback.
"""


class LabError(Exception):
    """A problem with input, the host or a VM that the user can act on."""

    def __init__(self, what: str, fix: str = ""):
        self.what = what
        self.fix = fix
        super().__init__(f"{what}{' -- ' + fix if fix else ''}")
