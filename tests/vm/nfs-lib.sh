# SPDX-License-Identifier: GPL-2.0-only
# shellcheck shell=bash
# Images on NFS, in the guest (sourced): the kernel NFS server exports a
# directory of the scratch disk, and two NFSv4.2 clients mount it, each
# standing in for a host of its own:
#   NFS1  a mount from this network namespace, over 127.0.0.1;
#   NFS2  a mount from the network namespace "nfs-h2" (a veth pair,
#         10.99.0.2 -> 10.99.0.1) and another host name: the server sees
#         another client, with its own NFSv4 client id, opens and locks.
# Both mounts are in the guest's one mount namespace, so any process can
# use either path; what decides the NFS client is the network namespace
# the mount was made from. Hard mounts (NFS's default): I/O to a server
# that went away waits until it is back.
#
# The server's lease and grace times are 10 s (the least it takes), so
# that a restart's grace period, in which no new lock is granted, is short.

NFS_EXPORT=/tmp/nfs-export
NFS1=/tmp/nfs1
NFS2=/tmp/nfs2
NFS_OPTS=vers=4.2,hard,timeo=50

# nfs_server_start: the server, once per guest (a restart after
# nfs_server_stop only starts its threads again). Its record of its
# clients is kept by nfsdcld (as on a Debian server), so that after a
# restart they reclaim their opens and locks.
nfs_server_start() {
	if [ -e /run/nfs-lib.started ]; then
		rpc.nfsd --no-udp -N 3 8 || fail "rpc.nfsd restart" || return 1
		return 0
	fi
	modprobe nfsd && modprobe nfsv4 && modprobe veth ||
		fail "no NFS server, NFSv4 client or veth module" || return 1
	mountpoint -q /proc/fs/nfsd || mount -t nfsd nfsd /proc/fs/nfsd ||
		return 1
	# the root is read-only in the guest: the server's state in tmpfs
	mount -t tmpfs -o mode=755 tmpfs /var/lib/nfs || return 1
	mkdir -p /var/lib/nfs/nfsdcld /run/rpc_pipefs &&
		touch /var/lib/nfs/etab /var/lib/nfs/rmtab || return 1
	# the server's record of its clients, kept across a restart by
	# nfsdcld, so that they may reclaim their opens and locks in the grace
	# period: it must be waiting on rpc_pipefs (Debian's place for it)
	# before nfsd starts
	mountpoint -q /run/rpc_pipefs ||
		mount -t rpc_pipefs sunrpc /run/rpc_pipefs || return 1
	nfsdcld -F >/tmp/nfsdcld.log 2>&1 &
	sleep 2
	echo 10 >/proc/fs/nfsd/nfsv4leasetime &&
		echo 10 >/proc/fs/nfsd/nfsv4gracetime || return 1
	mkdir -p "$NFS_EXPORT" || return 1
	mountpoint -q "$NFS_EXPORT" ||
		mount --bind "$SCRATCH" "$NFS_EXPORT" || return 1
	rpcbind -w 2>/dev/null || rpcbind || fail "rpcbind" || return 1
	exportfs -o rw,sync,no_root_squash,no_subtree_check,insecure,fsid=0 \
		"127.0.0.1:$NFS_EXPORT" "10.99.0.2:$NFS_EXPORT" ||
		fail "exportfs" || return 1
	rpc.mountd --no-udp -N 2 -N 3 || fail "rpc.mountd" || return 1
	rpc.nfsd --no-udp -N 3 8 || fail "rpc.nfsd" || return 1
	touch /run/nfs-lib.started
}

# nfs_server_stop: the server's threads stop; its clients' requests wait
# (hard mounts) until nfs_server_start.
nfs_server_stop() {
	rpc.nfsd 0
}

# nfs_server_forget: with the server stopped, it loses its record of its
# clients (as a server whose state directory is lost or not kept): at the
# next start no client may reclaim anything.
nfs_server_forget() {
	pkill -x nfsdcld
	sleep 1
	rm -f /var/lib/nfs/nfsdcld/*
	nfsdcld -F >>/tmp/nfsdcld.log 2>&1 &
	sleep 2
}

# nfs_netns: the second "host"'s network namespace and link, once.
nfs_netns() {
	[ -e /run/netns/nfs-h2 ] && return 0
	if ! { ip netns add nfs-h2 &&
		ip link add nfs-v1 type veth peer name nfs-v2 netns nfs-h2 &&
		ip addr add 10.99.0.1/24 dev nfs-v1 && ip link set nfs-v1 up &&
		ip link set lo up &&
		ip -n nfs-h2 addr add 10.99.0.2/24 dev nfs-v2 &&
		ip -n nfs-h2 link set nfs-v2 up &&
		ip -n nfs-h2 link set lo up; }; then
		fail "cannot make the network namespace nfs-h2"
	fi
}

# nfs_mounts: the server and both client mounts, once per guest.
nfs_mounts() {
	nfs_server_start && nfs_netns || return 1
	mkdir -p "$NFS1" "$NFS2" || return 1
	if ! mountpoint -q "$NFS1"; then
		mount -t nfs4 -o "$NFS_OPTS" 127.0.0.1:/ "$NFS1" ||
			fail "NFS mount from this host" || return 1
	fi
	if ! mountpoint -q "$NFS2"; then
		# another network namespace and another host name: another
		# client to the server
		nsenter --net=/run/netns/nfs-h2 unshare --uts sh -c \
			"echo nfs-h2 >/proc/sys/kernel/hostname &&
			mount -t nfs4 -o $NFS_OPTS 10.99.0.1:/ $NFS2" ||
			fail "NFS mount from nfs-h2" || return 1
	fi
}

# nfs_scratch: the cases that follow keep their images on NFS: SCRATCH
# becomes a directory of the first client's mount.
nfs_scratch() {
	nfs_mounts || return 1
	mkdir -p "$NFS1/scratch" && SCRATCH=$NFS1/scratch
}
