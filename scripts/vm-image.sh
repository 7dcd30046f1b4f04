#!/bin/sh
# Builds the Debian 12 guest that the real-VM tests (make vm-test) boot with
# QEMU: what a cloud's stock image has (systemd, cloud-init with NoCloud,
# openssh-server, docker.io, apparmor, curl), and nothing of Tandem's.
#
#   scripts/vm-image.sh <dir> [variant...]
#
# writes <dir>/vmlinuz, <dir>/initrd.img and one raw ext4 root filesystem
# per variant, <dir>/<variant>.img (booted with root=/dev/vda):
#   full      the stock image
#   nocurl    without curl (the payload's installer cannot download)
#   nodocker  without Docker (docker.io, containerd, runc purged)
# The debootstrap is cached as <dir>/rootfs.tar; an image is rebuilt only
# when missing. Apt in the guest points at http://10.0.2.100/debian, which
# the tests forward to a mirror proxy of their own on this machine's
# loopback. Env: TANDEM_DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -eu
dir="${1:?usage: vm-image.sh <dir> [full|nocurl|nodocker ...]}"
shift
[ $# -gt 0 ] || set -- full
mirror="${TANDEM_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
work="$dir/.work.$$"
cleanup() {
	for m in dev/pts dev proc sys; do umount "$work/root/$m" 2>/dev/null || true; done
	rm -rf "$work"
}
trap cleanup EXIT INT TERM

# python3-cffi-backend: debootstrap does not resolve the virtual package
# python3-cryptography needs (cloud-init).
packages=python3-cffi-backend,locales,systemd-sysv,udev,dbus,linux-image-cloud-amd64,initramfs-tools,cloud-init,openssh-server,docker.io,apparmor,curl,ca-certificates,iproute2,sudo,netbase,procps,less

rootfs_tar() {
	[ -f "$dir/rootfs.tar" ] && return 0
	echo "vm-image: debootstrap bookworm (one-time, cached in $dir/rootfs.tar)" >&2
	mkdir -p "$work/root"
	debootstrap --variant=minbase --include="$packages" bookworm "$work/root" "$mirror" >"$work/debootstrap.log" 2>&1 || {
		tail -n 30 "$work/debootstrap.log" >&2
		echo "vm-image: debootstrap failed" >&2
		exit 1
	}
	r="$work/root"
	echo tandem-vm >"$r/etc/hostname"
	printf '/dev/vda / ext4 defaults,discard 0 1\n' >"$r/etc/fstab"
	# A cloud image's network: DHCP on the first NIC. cloud-init's own
	# network rendering is off (NoCloud here carries no network config).
	mkdir -p "$r/etc/systemd/network"
	printf '[Match]\nName=en* eth*\n\n[Network]\nDHCP=yes\n' >"$r/etc/systemd/network/10-dhcp.network"
	chroot "$r" systemctl enable systemd-networkd.service >/dev/null 2>&1
	printf 'nameserver 10.0.2.3\n' >"$r/etc/resolv.conf"
	printf 'deb http://10.0.2.100/debian bookworm main\n' >"$r/etc/apt/sources.list"
	rm -f "$r"/etc/ssh/ssh_host_* "$r/var/lib/dbus/machine-id"
	: >"$r/etc/machine-id"
	rm -rf "$r/usr/share/doc" "$r/usr/share/man" "$r/usr/share/locale" "$r/var/cache/apt/archives"/*.deb "$r/var/lib/apt/lists"/*
	tar -C "$r" --numeric-owner -cf "$dir/rootfs.tar.tmp" .
	mv "$dir/rootfs.tar.tmp" "$dir/rootfs.tar"
	rm -rf "$r"
}

image() { # variant
	[ -f "$dir/$1.img" ] && return 0
	rootfs_tar
	r="$work/root"
	rm -rf "$r"
	mkdir -p "$r"
	tar -C "$r" --numeric-owner -xf "$dir/rootfs.tar"
	# What a cloud's image configures: its datasource, the network left to
	# the image, /etc/hosts with the hostname, a locale that exists.
	cat >"$r/etc/cloud/cloud.cfg.d/90-tandem-vm.cfg" <<-'CFG'
		datasource_list: [NoCloud, None]
		network: {config: disabled}
		manage_etc_hosts: true
		locale: C.UTF-8
	CFG
	case "$1" in
	full) ;;
	nocurl) chroot "$r" dpkg --purge curl >/dev/null ;;
	nodocker) chroot "$r" dpkg --purge docker.io containerd runc tini >/dev/null ;;
	*) echo "vm-image: unknown variant $1" >&2; exit 2 ;;
	esac
	if [ ! -f "$dir/vmlinuz" ] || [ ! -f "$dir/initrd.img" ]; then
		for k in "$r"/boot/vmlinuz-*; do cp "$k" "$dir/vmlinuz"; done
		for k in "$r"/boot/initrd.img-*; do cp "$k" "$dir/initrd.img"; done
	fi
	truncate -s 0 "$dir/$1.img.tmp"
	mkfs.ext4 -q -F -L root -d "$r" "$dir/$1.img.tmp" 6G
	mv "$dir/$1.img.tmp" "$dir/$1.img"
	rm -rf "$r"
	echo "vm-image: $dir/$1.img" >&2
}

for v in "$@"; do image "$v"; done
