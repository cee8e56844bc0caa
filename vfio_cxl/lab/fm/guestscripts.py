"""The scripts the fabric manager runs in a guest, and the strict parsers of what they print.

A guest is not trusted: any process in it picks its own name (``comm``, 15 bytes, any byte but
NUL, newlines included) and names the files it opens; a guest root may replace any tool.  So:

* the holders and kill scripts run sh builtins only (no tool a guest root could replace);
* the scripts print fields that no guest-chosen text can forge: a holder's pid comes from the
  kernel's own ``/proc/PID`` directory name, its link to the GPU's VFIO node is checked with the
  shell's ``-ef`` (same inode; no link text is parsed), its name is printed last on its line,
  after ``printf %s`` (never ``echo``, which expands backslashes), read up to its first newline;
* the host splits on ``\\n`` only, takes each line whole or refuses the answer, and names what
  the guest printed when it refuses (:class:`GuestAnswerError`);
* the kill script checks, in the guest at the moment of the kill, that each pid still holds the
  GPU's node, and never signals pid 1.

Every script takes its root from ``$VFIO_CXL_SYSROOT`` (unset in a guest: ``/``) so the fast
tests run the real scripts against a fake ``/proc`` and ``/sys`` tree.  POSIX sh builtins in the
loops: a guest Python start costs seconds and every fork tens of ms under TCG.
"""

from __future__ import annotations

import json
import math
import re

from ...errors import LabError

MAX_HOLDERS = 256            # holder lines the host takes; a guest with more is refused
HOLDERS_OUTPUT_MAX = 64 << 10
BIND_OUTPUT_MAX = 64 << 10
KILL_OUTPUT_MAX = 16 << 10

# Once per VM at lab start: vfio-pci loaded and told the GPU's ID (new_id), so the guest kernel
# binds every GPU it enumerates -- at boot and at hot-add -- itself, in its own hot-plug path: no
# guest command has to bind a moved GPU.  (EEXIST when the ID is already there: fine.)
PREPARE_SCRIPT = r"""[ -d /sys/bus/pci/drivers/vfio-pci ] || modprobe vfio-pci || exit 1
echo 0601 1991 > /sys/bus/pci/drivers/vfio-pci/new_id 2>/dev/null
[ -d /sys/bus/pci/drivers/vfio-pci ]
"""

# After device_add, one guest command on the FM's open SSH connection: wait until the VM has $1
# GPUs, each bound to vfio-pci (the kernel binds them: PREPARE_SCRIPT), at most $2 s by the
# guest's uptime (a count of 20 ms polls took far longer under TCG load, past the FM's wait for
# the answer, which then said only that the script did not answer).  The guest has no udev
# daemon, so it polls sysfs every 20 ms.  A GPU still unbound after 2 s (a kernel
# without the new_id, say) is bound here with driver_override + drivers_probe.
# Prints JSON: the new GPU's BDF and guest uptimes (s) when the script started, first saw the new
# GPU, saw it bound; first_scan: it was there at the first scan already (so it appeared during
# the SSH exec).  The guest's clock can run off the host's under TCG load: only differences of
# guest times are used.  Scripts go to the guest as `sh -c` arguments, never on stdin: invoke
# feeds stdin a byte at a time with a 10 ms sleep (a 1.5 KB script took 16 s).
BIND_SCRIPT = r"""R=${VFIO_CXL_SYSROOT-}; want=$1; limit=$2; n=0; first=false
read t_start _ < "$R/proc/uptime"; t_seen=""; new=""; t_end=$(( ${t_start%.*} + limit + 1 ))
while :; do
  set --; unbound=""
  for d in "$R"/sys/bus/pci/devices/*; do
    read v < "$d/vendor"; read i < "$d/device"
    if [ "$v:$i" = 0x0601:0x1991 ]; then
      b=${d##*/}; set -- "$@" "$b"
      [ -e "$R/sys/bus/pci/drivers/vfio-pci/$b" ] || unbound="$unbound $b"
    fi
  done
  if [ $# -ge $want ] && [ -z "$t_seen" ]; then read t_seen _ < "$R/proc/uptime"; new=$b; [ $n = 0 ] && first=true; fi
  [ $# -ge $want ] && [ -z "$unbound" ] && break
  n=$(( n + 1 ))
  if [ -n "$unbound" ] && [ $n -eq 100 ]; then
    [ -d "$R/sys/bus/pci/drivers/vfio-pci" ] || modprobe vfio-pci
    for b in $unbound; do
      echo vfio-pci > "$R/sys/bus/pci/devices/$b/driver_override" && echo $b > "$R/sys/bus/pci/drivers_probe"
    done
  fi
  read t_now _ < "$R/proc/uptime"
  [ ${t_now%.*} -ge $t_end ] && { echo "$# GPU(s) after $limit s, expected $want; not bound to vfio-pci:$unbound" >&2; exit 1; }
  sleep 0.02
done
read t_bound _ < "$R/proc/uptime"
echo "{\"bdf\": \"$new\", \"driver\": \"vfio-pci\", \"gpus\": $#, \"guest\": {\"start\": $t_start, \"seen\": $t_seen, \"bound\": $t_bound, \"first_scan\": $first}}"
"""

# The GPU's VFIO nodes ($1: its BDF): its group's /dev/vfio/N and, if the kernel made one, its
# iommufd cdev /dev/vfio/devices/vfioM; holds PID: does PID have one of them open (same inode), or
# a device fd whose fdinfo names the GPU (vfio-device-syspath).  The last is how a cdev holder is
# found while the GPU is being removed: vfio deletes the cdev and its node before it waits for
# the holders to close, so their fds then point at "/dev/vfio/devices/vfioM (deleted)".  Only
# character-device fds have their fdinfo read (no fork); a match's node is its link, read then.
_NODES = r"""R=${VFIO_CXL_SYSROOT-}; d=$R/sys/bus/pci/devices/$1
g=; for n in "$R"/sys/kernel/iommu_groups/*; do [ "$d/iommu_group" -ef "$n" ] && g=${n##*/}; done
[ -n "$g" ] || { echo "no IOMMU group for $1"; exit 1; }
group=/dev/vfio/$g; cdev=
for c in "$d"/vfio-dev/vfio*; do [ -e "$c" ] && cdev=/dev/vfio/devices/${c##*/}; done
syspath=$(cd -P "$d" && pwd); syspath=${syspath#"$R"}
holds() {
  for fd in "$R/proc/$1/fd/"*; do
    [ "$fd" -ef "$R$group" ] && { node=$group; return 0; }
    [ -n "$cdev" ] && [ "$fd" -ef "$R$cdev" ] && { node=$cdev; return 0; }
    [ -c "$fd" ] && [ -r "${fd%/fd/*}/fdinfo/${fd##*/}" ] || continue
    while IFS= read -r line; do
      [ "$line" = "vfio-device-syspath: $syspath" ] || continue
      node=$(readlink "$fd"); node=${node% (deleted)}
      case $node in /dev/vfio/devices/vfio[0-9]*) ;; *) node=$group ;; esac
      return 0
    done < "${fd%/fd/*}/fdinfo/${fd##*/}"
  done
  return 1
}
"""

# The processes holding the GPU at $1 open.  Prints "group NODE", "cdev NODE" (if any), then one
# "holder PID NODE NAME" line per process: NAME (its comm up to a newline) last, so nothing in it
# can shift the fields before it.
HOLDERS_SCRIPT = _NODES + r"""printf 'group %s\n' "$group"; [ -n "$cdev" ] && printf 'cdev %s\n' "$cdev"
for p in "$R"/proc/[0-9]*; do
  p=${p##*/}
  holds "$p" || continue
  comm=; { IFS= read -r comm < "$R/proc/$p/comm"; } 2>/dev/null
  printf 'holder %s %s %s\n' "$p" "$node" "$comm"
done
"""

# SIGKILL to the pids after $1 (the GPU's BDF) that hold its node at this moment (checked here,
# in the guest, right before the kill); pid 1 and anything that is not a pid are skipped.
# Prints "killed PID" or "skipped PID REASON" per pid.
KILL_SCRIPT = _NODES + r"""shift
for p; do
  case $p in ''|*[!0-9]*) printf 'skipped %s not-a-pid\n' "$p"; continue ;; esac
  if [ "$p" -le 1 ]; then printf 'skipped %s init\n' "$p"; continue; fi
  if holds "$p"; then
    kill -9 "$p" 2>/dev/null && printf 'killed %s\n' "$p" || printf 'skipped %s gone\n' "$p"
  else
    printf 'skipped %s not-holding\n' "$p"
  fi
done
"""


class GuestAnswerError(LabError):
    """A guest script printed something that is not its format."""


def show(text: str, limit: int = 200) -> str:
    """What a guest printed, for a message: repr'd (control characters visible), cut."""
    shown = repr(text[:limit])
    return shown + (f" ... ({len(text)} characters)" if len(text) > limit else "")


_NODE = r"/dev/vfio/(?:\d{1,9}|devices/vfio\d{1,9})"
_CDEV = re.compile(r"/dev/vfio/devices/vfio\d{1,9}")
_HOLDER = re.compile(rf"holder ([1-9]\d{{0,9}}) ({_NODE}) (.{{0,64}})", re.S)


def parse_holders(vm: str, out: str) -> list[dict]:
    """The holder list of HOLDERS_SCRIPT's output, strictly: each line whole, or refused."""
    lines = out.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    nodes, holders = set(), []
    for number, line in enumerate(lines, 1):
        kind = line.split(" ", 1)[0]
        if kind in ("group", "cdev") and number <= 2 and re.fullmatch(rf"{kind} {_NODE}", line):
            nodes.add(line.split(" ", 1)[1])
            continue
        match = _HOLDER.fullmatch(line)
        # a cdev holder while the GPU is being removed: its node is gone from sysfs (no cdev line)
        removed_cdev = match and _CDEV.fullmatch(match.group(2)) and not any(_CDEV.fullmatch(n) for n in nodes)
        if not match or not (match.group(2) in nodes or removed_cdev):
            raise GuestAnswerError(f"VM {vm}: the holders script printed line {number} not in its format: "
                                   f"{show(line)}", "is the guest's sh or /proc replaced? see its console log")
        if len(holders) == MAX_HOLDERS:
            raise GuestAnswerError(f"VM {vm}: more than {MAX_HOLDERS} processes hold the GPU",
                                   "stop them in the guest")
        holders.append({"pid": int(match.group(1)), "path": match.group(2), "comm": match.group(3)})
    if not nodes:
        raise GuestAnswerError(f"VM {vm}: the holders script did not name the GPU's VFIO group: "
                               f"{show(out)}", "is the GPU bound to vfio-pci there? (vfio-cxl gpu ls)")
    return holders


_KILLED = re.compile(r"killed ([1-9]\d{0,9})|skipped (\S{1,20}) (not-a-pid|init|gone|not-holding)")


def parse_kills(vm: str, out: str) -> tuple[list[int], dict[str, str]]:
    """(pids killed, pid -> why skipped) of KILL_SCRIPT's output, strictly."""
    killed, skipped = [], {}
    for line in out.split("\n"):
        if not line:
            continue
        match = _KILLED.fullmatch(line)
        if not match:
            raise GuestAnswerError(f"VM {vm}: the kill script printed a line not in its format: {show(line)}",
                                   "is the guest's sh replaced? see its console log")
        if match.group(1):
            killed.append(int(match.group(1)))
        else:
            skipped[match.group(2)] = match.group(3)
    return killed, skipped


_BDF = re.compile(r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]")


def parse_bind(vm: str, out: str) -> dict:
    """BIND_SCRIPT's answer (its last line), checked field by field."""
    last = out.rstrip("\n").rsplit("\n", 1)[-1]

    def refuse(what: str):
        raise GuestAnswerError(f"VM {vm}: the bind check's answer {what}: {show(last)}",
                               "is the guest's sh or sysfs replaced? see its console log; "
                               "vfio-cxl fm restart GPU starts over")
    try:
        answer = json.loads(last)
    except (ValueError, RecursionError):
        refuse("is not JSON")
    if not isinstance(answer, dict) or set(answer) != {"bdf", "driver", "gpus", "guest"}:
        refuse("does not have the fields bdf, driver, gpus, guest")
    if not isinstance(answer["bdf"], str) or not _BDF.fullmatch(answer["bdf"]):
        refuse("has no PCI address in bdf")
    if answer["driver"] != "vfio-pci" or type(answer["gpus"]) is not int or answer["gpus"] < 1:
        refuse("has a wrong driver or GPU count")
    guest = answer["guest"]
    if not isinstance(guest, dict) or set(guest) != {"start", "seen", "bound", "first_scan"} \
            or type(guest["first_scan"]) is not bool \
            or not all(type(guest[k]) in (int, float) and math.isfinite(guest[k]) and guest[k] >= 0
                       for k in ("start", "seen", "bound")):
        refuse("has no guest times (numbers: start, seen, bound; first_scan: a bool)")
    return answer
