#!/bin/sh
# The lab's CXL ram regions for devdax, made straight through the kernel's region ABI
# (Documentation/ABI/testing/sysfs-bus-cxl) in the order cxl-cli's create-region writes it,
# with no exec: the guest's init runs it at every boot, before SSH answers (under TCG a Python
# start costs ~0.6 s and each cxl-cli or daxctl exec ~50-100 ms).  Plans with pmem regions or
# namespaces go to `python3 -m vfio_cxl.guest.cmd.cxltool regions` (cxl-cli, ndctl) instead.
#
#   sh ram_regions.sh < PLAN      PLAN: one region a line, NAME WINDOW GRANULARITY SERIALS
#                                 (SERIALS: the memdevs' serial numbers, comma separated, in
#                                 interleave position order; vfio_cxl.lab.lab.ram_regions_plan)
#
# Prints the regions as JSON, as `cxltool regions` does: name, region, type, memdevs, size,
# ways, granularity, use, dax.  Each region is as large as its memdevs' free ram allows, in
# multiples of 256 MiB per way.  A step that fails is named on stderr (exit 1), and the region
# it was making is taken apart again.  $SYSFS: the sysfs root (tests).
sys=${SYSFS:-/sys}
cxl=$sys/bus/cxl/devices
align=$((256 << 20))
wait_ticks=1000                 # 10 ms each: what a device the kernel adds after a probe may take

fail() { echo "ram_regions: $*" >&2; exit 1; }
nap() { usleep 10000 2>/dev/null || sleep 0.01; }   # 10 ms: busybox's applet, else sleep(1)
# echo: a regular builtin, so a failed write returns 1 instead of ending the shell.
put() { echo "$2" 2>/dev/null > "$1" || { echo "ram_regions: writing '$2' to $1 failed" >&2; return 1; }; }

# The memdev with serial $1 and its endpoint port, once the CXL drivers have probed both:
# sets mem and endpoint.
find_memdev() {
    i=0
    while :; do
        mem= endpoint=
        for m in "$cxl"/mem*; do
            [ -r "$m/serial" ] || continue
            read -r s < "$m/serial"
            [ $((s)) -eq $(($1)) ] && mem=${m##*/}
        done
        if [ -n "$mem" ]; then
            for e in "$cxl"/endpoint*; do
                [ -e "$e/uport" ] || continue
                link=$(readlink "$e/uport")
                [ "${link##*/}" = "$mem" ] && endpoint=$e
            done
        fi
        [ -n "$endpoint" ] && return 0
        i=$((i + 1))
        [ $i -le $wait_ticks ] || fail "no memdev with serial $1 and an endpoint port: is cxl_mem loaded and every Type3 device enabled? (cxl list -M)"
        nap
    done
}

# The first decoder of endpoint port $1 that maps nothing, and the ram no decoder maps yet
# (of memdev $2): sets decoder and free.
free_decoder() {
    decoder=
    read -r free < "$cxl/$2/ram/size"
    free=$((free))
    for d in "$1"/decoder*.*; do
        read -r size < "$d/dpa_size"
        read -r mode < "$d/mode"
        [ "$mode" = ram ] && free=$((free - size))
        [ -z "$decoder" ] && [ $((size)) -eq 0 ] && decoder=$d
    done
    [ -n "$decoder" ] || fail "$2: every endpoint decoder is in use (cxl list -D -m $2)"
}

undo() {   # $1 root decoder, $2 region; $decoders: take a half-made region apart, best effort
    put "$sys/bus/cxl/drivers/cxl_region/unbind" "$2" 2>/dev/null
    put "$cxl/$2/commit" 0 2>/dev/null
    i=0
    for d in $decoders; do put "$cxl/$2/target$i" "" 2>/dev/null; i=$((i + 1)); done
    for d in $decoders; do put "$d/dpa_size" 0 2>/dev/null; done
    put "$1/delete_region" "$2" 2>/dev/null
}

# Region $2 made from root decoder $1 with $ways ways of $per_way bytes over $decoders.
make_region() {
    put "$cxl/$2/interleave_granularity" "$3" || return 1
    put "$cxl/$2/interleave_ways" "$ways" || return 1
    for d in $decoders; do
        put "$d/mode" ram || return 1
        put "$d/dpa_size" "$per_way" || return 1
    done
    put "$cxl/$2/size" $((per_way * ways)) || return 1
    i=0
    for d in $decoders; do put "$cxl/$2/target$i" "${d##*/}" || return 1; i=$((i + 1)); done
    put "$cxl/$2/commit" 1 || return 1
    put "$sys/bus/cxl/drivers/cxl_region/bind" "$2" || return 1
    # its dax device comes from the driver's probe; device_dax takes it by name (it matches only
    # kmem by type, blacklisted in the image), as daxctl enable-device does
    i=0
    dax=
    while [ -z "$dax" ]; do
        for x in "$cxl/$2"/dax_region*/dax*.*; do [ -e "$x" ] && dax=${x##*/}; done
        [ -n "$dax" ] && break
        i=$((i + 1))
        [ $i -le $wait_ticks ] || { echo "ram_regions: $2 has no dax device: is dax_cxl loaded?" >&2; return 1; }
        nap
    done
    if [ ! -e "$sys/bus/dax/devices/$dax/driver" ]; then
        put "$sys/bus/dax/drivers/device_dax/new_id" "$dax" 2>/dev/null \
            || put "$sys/bus/dax/drivers/device_dax/bind" "$dax" || return 1
    fi
}

sep=
printf '['
while read -r name window granularity serials; do
    [ -n "$name" ] || continue
    roots=
    for d in "$cxl"/root*/decoder*.*; do [ -e "$d" ] && roots="$roots $d"; done
    set -- $roots
    [ "$window" -lt $# ] || fail "no root decoder for window $window (the guest has $#): is cxl_acpi loaded?"
    shift "$window"
    root=$1
    decoders= mems= ways=0 per_way=
    saved_ifs=$IFS
    IFS=,
    set -- $serials
    IFS=$saved_ifs
    for serial in "$@"; do
        find_memdev "$serial"
        free_decoder "$endpoint" "$mem"
        decoders="$decoders $decoder"
        mems="$mems${mems:+, }\"$mem\""
        ways=$((ways + 1))
        [ -z "$per_way" ] || [ "$free" -lt "$per_way" ] && per_way=$free
    done
    per_way=$((per_way / align * align))
    [ "$per_way" -gt 0 ] || fail "region $name: no free ram on its memdevs (cxl list -R shows what maps it)"
    read -r region < "$root/create_ram_region"
    put "$root/create_ram_region" "$region" || fail "region $name: cannot create a region under ${root##*/}"
    if ! make_region "$root" "$region" "$granularity"; then
        undo "$root" "$region"
        fail "region $name: $region taken apart again (see dmesg for the CXL driver's reason)"
    fi
    read -r size < "$cxl/$region/size"
    read -r got_ways < "$cxl/$region/interleave_ways"
    read -r got_granularity < "$cxl/$region/interleave_granularity"
    printf '%s{"name": "%s", "region": "%s", "type": "ram", "memdevs": [%s], "size": %d, "ways": %d, "granularity": %d, "use": "devdax", "dax": "%s"}' \
        "$sep" "$name" "$region" "$mems" $((size)) "$got_ways" "$got_granularity" "$dax"
    sep=", "
done
printf ']\n'
