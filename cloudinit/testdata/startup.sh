#!/bin/bash
# Tandem: install and supervise dstack-shim (rendered by tandem cloudinit --script).
set -euo pipefail
mkdir -p "/usr/local/lib/tandem"
cat > "/usr/local/lib/tandem/install-agents.sh" <<'TANDEM_EOF'
#!/bin/bash
# Installs and starts Tandem's dstack-shim and dstack-runner (rendered by
# tandem cloudinit). Run it again after fixing what it reported.
set -euo pipefail
self=/usr/local/lib/tandem/install-agents.sh
fail() {
  echo "tandem: $*" >&2
  logger -p user.err -t tandem-install -- "$*" 2>/dev/null || true
  exit 1
}
warn() {
  echo "tandem: $*" >&2
  logger -p user.warning -t tandem-install -- "$*" 2>/dev/null || true
}
download() { # url dest
  if command -v curl >/dev/null; then
    curl -fsSL --connect-timeout 10 -m 600 -o "$2" "$1"
  else
    wget -q -T 10 -O "$2" "$1"
  fi
}
fetch() { # url dest sha256
  local url=$1 dest=$2 sum=$3 tmp i err
  command -v curl >/dev/null || command -v wget >/dev/null ||
    fail "cannot download $url: this image has neither curl nor wget. Install curl (apt-get install -y curl), or use an image with the agents baked in (packer/), then run $self again."
  tmp=$(mktemp "${dest}.XXXXXX")
  for i in 1 2 3 4 5 6; do
    if err=$(download "$url" "$tmp" 2>&1); then break; fi
    if [ "$i" = 6 ]; then
      rm -f "$tmp"
      fail "cannot download $url after 6 tries (${err:-no error text}). Check that this host reaches it, then run $self again."
    fi
    sleep $((i * 2))
  done
  if [ -n "$sum" ] && ! echo "$sum  $tmp" | sha256sum -c - >/dev/null; then
    rm -f "$tmp"; fail "checksum mismatch for $url: the file is not the release it should be; check the URL and its SHA-256"
  fi
  chmod 0755 "$tmp"
  mv -f "$tmp" "$dest"
}
have() { [ -x "$1" ] && "$1" --version >/dev/null 2>&1; }
runs() { # bin: it must run here (a too-old glibc shows up now, not as a restart loop)
  local out
  out=$("$1" --version 2>&1) || fail "$1 does not run on this host: ${out}. dstack-shim needs glibc 2.31 or newer (Ubuntu 20.04, Debian 11)."
}
mkdir -p /usr/local/bin "/root/.dstack"
have /usr/local/bin/dstack-shim || fail "/usr/local/bin/dstack-shim is not baked into this image; build it with packer/ or render the payload with --shim-url"
have /usr/local/bin/dstack-runner || fail "/usr/local/bin/dstack-runner is not baked into this image; build it with packer/ or render the payload with --runner-url"
runs /usr/local/bin/dstack-shim
runs /usr/local/bin/dstack-runner
# Docker's data root on the instance-store NVMe, if any, before Docker
# starts (or moved, Docker stopped meanwhile); at every boot after this.
systemctl daemon-reload
systemctl enable tandem-docker-data-root.service >/dev/null 2>&1 || warn "could not enable tandem-docker-data-root.service"
/usr/local/lib/tandem/docker-data-root.sh || warn "Docker's data root was not moved to the instance store (see above): Docker stays on the boot disk"
docker_missing=
if ! command -v dockerd >/dev/null; then
  docker_missing=1
fi
# Pulls: Docker unpacks each layer with unpigz (all cores) where it is
# installed, else with one core of gzip; and it downloads more layers at
# once than its default 3 (a value the operator set in daemon.json is
# kept; Docker takes it on reload).
if ! command -v unpigz >/dev/null && command -v apt-get >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get -q -y install pigz >&2 ||
    { apt-get -q update >&2 && DEBIAN_FRONTEND=noninteractive apt-get -q -y install pigz >&2; } ||
    warn "pigz not installed: Docker unpacks each pulled layer on one core"
fi
pulls=0
command -v python3 >/dev/null && mkdir -p /etc/docker && python3 - /etc/docker/daemon.json <<'PY' || pulls=$?
import json, os, sys
p = sys.argv[1]
try:
    with open(p) as f:
        d = json.load(f)
except FileNotFoundError:
    d = {}
if "max-concurrent-downloads" in d:
    sys.exit(3)
d["max-concurrent-downloads"] = 8
with open(p + ".tandem", "w") as f:
    json.dump(d, f, indent=2)
    f.write("\n")
os.replace(p + ".tandem", p)
PY
case $pulls in
  0) systemctl reload docker.service >/dev/null 2>&1 || true ;;
  3) ;;
  *) warn "Docker's max-concurrent-downloads not set: no python3, or /etc/docker/daemon.json unreadable" ;;
esac
if [ -z "$docker_missing" ]; then
  systemctl enable --now docker.service >/dev/null 2>&1 || warn "Docker is installed but did not start: see systemctl status docker"
fi
if command -v ufw >/dev/null; then
  ufw --force reset >/dev/null
  ufw default deny incoming
  ufw default allow outgoing
  ufw allow ssh
  ufw allow from 10.0.0.0/8
  ufw allow from 172.16.0.0/12
  ufw allow from 192.168.0.0/16
  ufw --force enable
else
  warn "ufw not found; firewall left as is"
fi
systemctl daemon-reload
systemctl enable --now dstack-shim.service || fail "dstack-shim did not start: see journalctl -u dstack-shim"
if [ -n "$docker_missing" ]; then
  fail "Docker is not installed, so no task can start; the shim runs and reports the instance unhealthy. Install it (apt-get install -y docker.io) or render the payload with tandem cloudinit --install-docker."
fi
TANDEM_EOF
chmod 0755 "/usr/local/lib/tandem/install-agents.sh"
mkdir -p "/etc/dstack"
cat > "/etc/dstack/shim.env" <<'TANDEM_EOF'
DSTACK_RUNNER_BINARY_PATH="/usr/local/bin/dstack-runner"
DSTACK_RUNNER_HTTP_PORT="10999"
DSTACK_RUNNER_LOG_LEVEL="5"
DSTACK_RUNNER_SSH_PORT="10022"
DSTACK_SHIM_HOME="/root/.dstack"
DSTACK_SHIM_HTTP_PORT="10998"
DSTACK_SHIM_LOG_LEVEL="5"
HF_HOME="/data/hf"
TANDEM_EOF
chmod 0600 "/etc/dstack/shim.env"
mkdir -p "/etc/systemd/system"
cat > "/etc/systemd/system/dstack-shim.service" <<'TANDEM_EOF'
[Unit]
Description=dstack-shim (Tandem): runs dstack tasks as Docker containers
Documentation=https://github.com/tandem-run/tandem
After=network-online.target docker.service
Wants=network-online.target docker.service
# A binary that is not there is not started (no restart loop); one that
# keeps failing is given up on after 20 tries in 10 minutes (see
# systemctl status); a Docker that comes up late does not stop the shim.
ConditionFileIsExecutable=/usr/local/bin/dstack-shim
StartLimitIntervalSec=600
StartLimitBurst=20

[Service]
# notify: active once the API serves and tasks are recovered; the watchdog
# restarts a shim that stops answering itself.
Type=notify
NotifyAccess=main
WatchdogSec=60
TimeoutStartSec=300
User=root
EnvironmentFile=/etc/dstack/shim.env
# The images a Packer build pulled into the machine image: image GC keeps
# them (packer/scripts/50-prepull.sh writes it; none: no file).
EnvironmentFile=-/etc/dstack/prepulled.env
ExecStart=/usr/local/bin/dstack-shim
Restart=always
RestartSec=3
KillMode=process
LimitNOFILE=1048576

[Install]
WantedBy=multi-user.target
TANDEM_EOF
chmod 0644 "/etc/systemd/system/dstack-shim.service"
mkdir -p "/usr/local/lib/tandem"
cat > "/usr/local/lib/tandem/docker-data-root.sh" <<'TANDEM_EOF'
#!/bin/bash
# Docker's data root on the instance-store NVMe, when the host has one:
# multi-GB images and layers belong on the fast local disk, not the boot
# disk. Runs at every boot before Docker (tandem-docker-data-root.service)
# and from the cloud-init payload; idempotent.
#
# Never formats a disk that holds data (the rule volumes follow). A disk
# this script formatted carries the label tandem-ephemeral and is mounted
# again after a reboot. Any other disk is formatted only when certainly new
# and unused (claim_and_format; docker-data-root.md says how); else it is
# left as it is and Docker stays on the boot disk. A data root the
# operator chose in daemon.json is left alone.
#
# Instance stores are told apart from network disks by their NVMe model:
# "Amazon EC2 NVMe Instance Storage", "Microsoft NVMe Direct Disk" (Azure),
# "nvme_card" (Google Cloud local SSD; its persistent disks are
# "nvme_card-pd"). The first such disk is used.
set -euo pipefail
SYS=${TANDEM_SYS:-/sys}
DEV=${TANDEM_DEV:-/dev}
MNT=${TANDEM_EPHEMERAL_MOUNT:-/mnt/ephemeral}
DAEMON_JSON=${TANDEM_DOCKER_DAEMON_JSON:-/etc/docker/daemon.json}
DEFAULT_ROOT=${TANDEM_DOCKER_DEFAULT_ROOT:-/var/lib/docker}
STATE=${TANDEM_STATE_DIR:-/var/lib/tandem}
INSTANCE_ID_FILE=${TANDEM_INSTANCE_ID_FILE:-/var/lib/cloud/data/instance-id}
MACHINE_ID_FILE=${TANDEM_MACHINE_ID_FILE:-/etc/machine-id}
FORMAT_DISKS=${TANDEM_FORMAT_DISKS:-/etc/tandem/format-disks}
# 256 GiB is about two minutes at the 2 GB/s an instance store reads at,
# once, at the first boot that sees the disk.
READ_MAX_MIB=${TANDEM_BLANK_READ_MAX_MIB:-262144}
READ_MAX_SECONDS=${TANDEM_BLANK_READ_MAX_SECONDS:-600}
LABEL=tandem-ephemeral
log() { echo "tandem-docker-data-root: $*" >&2; }

# daemon.json is read and written with python3, which every host with
# cloud-init has (jq may not be installed yet).
json_get() { # key: its value in daemon.json, empty when unset
  [ -f "$DAEMON_JSON" ] || return 0
  python3 -c 'import json,sys; v=json.load(open(sys.argv[1])).get(sys.argv[2]); print(v if v is not None else "")' "$DAEMON_JSON" "$1"
}
json_set() { # key value: set in daemon.json, the rest kept
  python3 - "$DAEMON_JSON" "$1" "$2" <<'PY'
import json, os, sys
path, key, value = sys.argv[1:]
try:
    with open(path) as f:
        cfg = json.load(f)
except FileNotFoundError:
    cfg = {}
cfg[key] = value
with open(path + ".new", "w") as f:
    json.dump(cfg, f, indent=2)
    f.write("\n")
os.replace(path + ".new", path)
PY
}

want="$MNT/docker"
if [ -f "$DAEMON_JSON" ]; then
  current=$(json_get data-root)
  if [ -n "$current" ] && [ "$current" != "$want" ]; then
    log "daemon.json sets data-root to $current: left as the operator chose"
    exit 0
  fi
fi

instance_store() {
  local b model
  for b in "$SYS"/block/nvme*n*; do
    [ -e "$b/device/model" ] || continue
    case "$(basename "$b")" in *p[0-9]*) continue ;; esac
    model=$(tr -s ' ' <"$b/device/model" | sed 's/^ //; s/ $//')
    case "$model" in
    "Amazon EC2 NVMe Instance Storage" | "Microsoft NVMe Direct Disk"* | "nvme_card")
      basename "$b"
      return 0
      ;;
    esac
  done
  return 1
}

mounted_at() { # the mount point of device $1, if mounted
  awk -v d="$1" '$1 == d {print $2; exit}' /proc/self/mounts
}

# claim_and_format DEV SYSDIR: format DEV (ext4, our label) only when it
# is certainly new and unused; exit 0 formatted, 3 refused (logged and
# recorded), else failed. python3 holds the exclusive open and the udev
# lock while it checks; the order and what it leaves: docker-data-root.md.
claim_and_format() {
  python3 - "$1" "$2" "$LABEL" "$STATE/docker-data-root-disks.json" "$INSTANCE_ID_FILE" "$MACHINE_ID_FILE" \
    "$FORMAT_DISKS" "$READ_MAX_MIB" "$READ_MAX_SECONDS" <<'PY'
import errno, fcntl, json, os, stat, subprocess, sys, time

dev, sysdir, label, state_path, id_file, machine_id_file, opt_in_path = sys.argv[1:8]
read_max = int(sys.argv[8]) << 20
read_max_s = float(sys.argv[9])
CHUNK = 16 << 20


class Refused(Exception):
    pass


def log(msg):
    print("tandem-docker-data-root: " + msg, file=sys.stderr, flush=True)


def small(path, limit=4096):
    """The first limit bytes of a sysfs or config file, stripped."""
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", "replace").strip()


def instance_id():
    for p in (id_file, machine_id_file):
        try:
            v = small(p, 256)
        except OSError:
            continue
        if v and v.isprintable():
            return v
    return ""


def serial():
    for p in ("device/serial", "wwid", "device/wwid"):
        try:
            v = " ".join(small(os.path.join(sysdir, p), 256).split())
        except OSError:
            continue
        if v and v.isprintable():
            return v
    return ""


def load_state():
    try:
        with open(state_path, "rb") as f:
            st = json.loads(f.read(1 << 20))
    except FileNotFoundError:
        return {"disks": {}}
    except (OSError, ValueError) as e:
        raise Refused("the record of disks seen, %s, cannot be read (%s): nothing is formatted until it is fixed" % (state_path, e))
    if not isinstance(st, dict) or not isinstance(st.get("disks"), dict):
        raise Refused("the record of disks seen, %s, is not ours: nothing is formatted until it is fixed" % state_path)
    return st


def save_state(st):
    # Written before each step it records and made durable (temp file,
    # fsync, rename, fsync of the directory): a boot that dies in the
    # middle finds the record of what it began.
    d = os.path.dirname(state_path)
    os.makedirs(d, mode=0o700, exist_ok=True)
    tmp = state_path + ".new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(st, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state_path)
    dfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def opted_in(ser):
    """The operator named this serial in the opt-in file, which only root
    may write."""
    try:
        fd = os.open(opt_in_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != 0 or st.st_mode & 0o022 or not stat.S_ISREG(st.st_mode):
            log("%s is not a root-owned file only root may write: ignored" % opt_in_path)
            return False
        lines = f.read(1 << 16).decode("utf-8", "replace").splitlines()
    return any(" ".join(l.split("#", 1)[0].split()) == ser for l in lines)


def writes():
    """Write I/Os and sectors the disk completed, and those in flight."""
    try:
        f = small(os.path.join(sysdir, "stat")).split()
        inflight = small(os.path.join(sysdir, "inflight")).split()
        return int(f[4]), int(f[6]), int(inflight[1])
    except (OSError, ValueError, IndexError) as e:
        raise Refused("its write counters cannot be read (%s)" % e)


def openers(rdev):
    """Other processes with the disk open (pid, command, for writing)."""
    me, found = os.getpid(), []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        base = "/proc/" + pid
        for sub in ("fd", "map_files"):
            try:
                names = os.listdir(base + "/" + sub)
            except OSError:
                continue
            for n in names:
                try:
                    st = os.stat(base + "/" + sub + "/" + n)
                except OSError:
                    continue
                if not stat.S_ISBLK(st.st_mode) or st.st_rdev != rdev:
                    continue
                writer = True  # a mapping, or flags unreadable: assume the worst
                if sub == "fd":
                    try:
                        for line in small(base + "/fdinfo/" + n).splitlines():
                            if line.startswith("flags:"):
                                writer = int(line.split()[1], 8) & os.O_ACCMODE != os.O_RDONLY
                    except (OSError, ValueError, IndexError):
                        pass
                try:
                    comm = small(base + "/comm", 64)
                except OSError:
                    comm = "?"
                found.append((int(pid), comm, writer))
    return found


def no_writers(rdev, when):
    procs = openers(rdev)
    w = ["%d (%s)" % (p, c) for p, c, wr in procs if wr]
    if w:
        raise Refused("open for writing by process %s %s" % (", ".join(sorted(set(w))), when))
    for p, c, _ in procs:
        log("%s is open for reading by process %d (%s) %s" % (dev, p, c, when))


def first_nonzero(fd, size):
    """The offset of the first byte that is not zero, or -1; every byte is
    read, 16 MiB at a time, and dropped from the page cache after."""
    buf, zero = bytearray(CHUNK), bytes(CHUNK)
    view = memoryview(buf)
    start, off = time.monotonic(), 0
    while off < size:
        n = os.preadv(fd, [view[: min(CHUNK, size - off)]], off)
        if n <= 0:
            raise Refused("it read short at byte %d of %d" % (off, size))
        if buf[:n] != zero[:n] if n < CHUNK else buf != zero:
            part = bytes(view[:n])
            return off + n - len(part.lstrip(b"\0"))
        os.posix_fadvise(fd, off, n, os.POSIX_FADV_DONTNEED)
        off += n
        if time.monotonic() - start > read_max_s:
            raise Refused("it was not read in full in %d s (%d of %d MiB): name its serial in %s to format it"
                          % (read_max_s, off >> 20, size >> 20, opt_in_path))
    log("%s: %d MiB read, all zeros, in %.1f s" % (dev, size >> 20, time.monotonic() - start))
    return -1


def check_and_format(record, optin):
    st = os.stat(dev)
    if not stat.S_ISBLK(st.st_mode):
        raise Refused("not a block device")
    rdev = st.st_rdev
    if small(os.path.join(sysdir, "dev")) != "%d:%d" % (os.major(rdev), os.minor(rdev)):
        raise Refused("its device number is not the one %s describes" % sysdir)
    name = os.path.basename(sysdir)
    if any(e.startswith(name) for e in os.listdir(sysdir)):
        raise Refused("it is partitioned")
    try:
        held = os.listdir(os.path.join(sysdir, "holders"))
    except FileNotFoundError:
        held = []
    if held:
        raise Refused("it is held by %s (RAID, LVM, dm)" % ", ".join(held))
    with open("/proc/self/mountinfo") as f:
        if any(l.split()[2] == "%d:%d" % (os.major(rdev), os.minor(rdev)) for l in f):
            raise Refused("it is mounted")
    for b in os.listdir("/sys/block"):
        try:
            if os.stat(small("/sys/block/%s/loop/backing_file" % b)).st_rdev == rdev:
                raise Refused("it backs the loop device %s" % b)
        except OSError:
            pass
    try:
        xfd = os.open(dev, os.O_RDONLY | os.O_EXCL | os.O_CLOEXEC)
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise Refused("it is in use (a mount, RAID, swap or another program holds it exclusively)")
        raise
    lfd = os.open(dev, os.O_RDONLY)  # inherited by mke2fs: the lock lasts through the format
    try:
        # udev holds a shared lock for the moments it probes a disk.
        for _ in range(100):
            try:
                fcntl.flock(lfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.1)
        else:
            raise Refused("another program holds its lock (flock)")
        if os.fstat(xfd).st_rdev != rdev or os.fstat(lfd).st_rdev != rdev:
            raise Refused("%s changed while it was opened" % dev)
        before = writes()
        no_writers(rdev, "when checked")
        sig = subprocess.run(["blkid", "-p", "-o", "export", "/dev/fd/%d" % xfd], pass_fds=(xfd,),
                             capture_output=True, text=True).stdout
        kinds = [l.split("=", 1)[1] for l in sig.splitlines() if l.startswith(("TYPE=", "PTTYPE="))]
        if kinds:
            raise Refused("it holds a %s signature this script did not make" % "/".join(kinds))
        size = os.lseek(xfd, 0, os.SEEK_END)
        if optin:
            log("%s: its serial is named in %s: formatted without reading it" % (dev, opt_in_path))
        elif size > read_max:
            raise Refused("it is too large to read in full at boot (%d GiB, above %d GiB), and no device report says it is blank: "
                          "name its serial in %s to format it" % (size >> 30, read_max >> 30, opt_in_path))
        else:
            at = first_nonzero(xfd, size)
            if at >= 0:
                raise Refused("it is not blank: data at byte %d" % at)
        os.fsync(lfd)  # a buffered writer's pages reach the counters
        no_writers(rdev, "after it was read")
        after = writes()
        # Sectors, not I/Os: the fsync's flush counts as a write of none.
        if after[1] != before[1] or after[2]:
            raise Refused("it was written to while it was checked (%d sectors, %d writes in flight)"
                          % (after[1] - before[1], after[2]))
        record.update(outcome="formatting", at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        commit()
        os.close(xfd)
        xfd = -1
        no_writers(rdev, "before the format")
        log("formatting the blank instance store %s (ext4, label %s)" % (dev, label))
        mk = subprocess.run(["mkfs.ext4", "-q", "-L", label, "-E", "nodiscard", "-m", "0", "/dev/fd/%d" % lfd],
                            pass_fds=(lfd,), stdin=subprocess.DEVNULL, capture_output=True, text=True)
        if mk.returncode != 0:
            raise Refused("mkfs.ext4 failed (exit %d): %s" % (mk.returncode, mk.stderr.strip()[-300:]))
        no_writers(rdev, "after the format")
    finally:
        if xfd >= 0:
            os.close(xfd)
        os.close(lfd)


ser, inst = serial(), instance_id()
if not ser or not inst:
    log("%s: refused, not formatted: no %s to record it by: Docker stays on the boot disk"
        % (dev, "serial" if not ser else "instance id (%s, %s)" % (id_file, machine_id_file)))
    sys.exit(3)
key = inst + "/" + ser
try:
    state = load_state()
except Refused as e:
    log("%s: refused, not formatted: %s: Docker stays on the boot disk" % (dev, e))
    sys.exit(3)
seen = state["disks"].get(key)
optin = opted_in(ser)
if seen is not None and not optin:
    what = {
        "formatting": "its format began and did not finish",
        "formatted": "it was formatted then and no longer carries the label %s: someone's data, or wiped" % label,
        "checking": "its check began and did not finish",
    }.get(seen.get("outcome"), "it was refused then: %s" % seen.get("reason", "?"))
    log("%s (serial %s): refused, not formatted: seen on an earlier boot of this instance (%s, %s): %s. "
        "Name its serial in %s to format it; Docker stays on the boot disk" % (dev, ser, inst, seen.get("at", "?"), what, opt_in_path))
    sys.exit(3)
record = {"device": dev, "outcome": "checking", "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
state["disks"][key] = record


def commit():
    save_state(state)


try:
    commit()
    check_and_format(record, optin)
except Refused as e:
    record.update(outcome="refused", reason=str(e))
    commit()
    log("%s (serial %s): refused, not formatted: %s: Docker stays on the boot disk" % (dev, ser, e))
    sys.exit(3)
record.update(outcome="formatted")
commit()
PY
}

if ! mountpoint -q "$MNT"; then
  if ! name=$(instance_store); then
    log "no instance-store NVMe: Docker stays on the boot disk"
    exit 0
  fi
  dev="$DEV/$name"
  real=$(readlink -f "$dev")
  if [ -n "$(mounted_at "$real")" ] || compgen -G "$SYS/block/$name/${name}p*" >/dev/null ||
    [ -n "$(ls -A "$SYS/block/$name/holders" 2>/dev/null)" ]; then
    log "$dev is partitioned, mounted or held (RAID, LVM): not touched"
    exit 0
  fi
  label=$(blkid -p -s LABEL -o value "$dev" 2>/dev/null || true)
  if [ "$label" != "$LABEL" ]; then
    rc=0
    claim_and_format "$dev" "$SYS/block/$name" || rc=$?
    case $rc in
    0) ;;
    3) exit 0 ;; # refused, said why: Docker stays on the boot disk
    *)
      log "$dev: the check or the format failed (exit $rc): not mounted, Docker stays on the boot disk"
      exit 1
      ;;
    esac
  fi
  mkdir -p "$MNT"
  mount -o noatime "$dev" "$MNT"
  log "$dev mounted on $MNT"
fi

mkdir -p "$want"
# Images baked into the image (prepull_images) are on the boot disk: the
# first boot copies them over, with Docker stopped.
if [ -z "$(ls -A "$want")" ] && [ -d "$DEFAULT_ROOT" ] && [ -n "$(ls -A "$DEFAULT_ROOT" 2>/dev/null)" ]; then
  running=
  if systemctl is-active --quiet docker.service; then
    running=1
    systemctl stop docker.socket docker.service
  fi
  log "copying $DEFAULT_ROOT to $want"
  cp -a "$DEFAULT_ROOT/." "$want/"
  [ -z "$running" ] || systemctl start docker.service
fi
mkdir -p "$(dirname "$DAEMON_JSON")"
if [ "$(json_get data-root)" != "$want" ]; then
  json_set data-root "$want"
  log "Docker's data root is $want"
  if systemctl is-active --quiet docker.service; then
    systemctl restart docker.service
  fi
fi
TANDEM_EOF
chmod 0755 "/usr/local/lib/tandem/docker-data-root.sh"
mkdir -p "/etc/systemd/system"
cat > "/etc/systemd/system/tandem-docker-data-root.service" <<'TANDEM_EOF'
[Unit]
Description=Tandem: Docker's data root on the instance-store NVMe
Documentation=https://github.com/tandem-run/tandem
# cloud-init's instance id, which keys the record of disks seen, is
# written by then (cloud-init.service is before sysinit.target anyway).
After=local-fs.target cloud-init-local.service cloud-init.service
Before=docker.service containerd.service dstack-shim.service
ConditionPathExists=/usr/local/lib/tandem/docker-data-root.sh

[Service]
Type=oneshot
RemainAfterExit=yes
# The blank check reads a disk of up to 256 GiB once, and gives up after
# 10 minutes itself: Docker (ordered after, not requiring this) starts on
# the boot disk however this ends.
TimeoutStartSec=15min
ExecStart=/usr/local/lib/tandem/docker-data-root.sh

[Install]
WantedBy=multi-user.target
TANDEM_EOF
chmod 0644 "/etc/systemd/system/tandem-docker-data-root.service"
mkdir -p /root/.ssh && chmod 700 /root/.ssh
grep -qxF 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop' /root/.ssh/authorized_keys 2>/dev/null || echo 'ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop' >> /root/.ssh/authorized_keys
chmod 600 /root/.ssh/authorized_keys
/usr/local/lib/tandem/install-agents.sh
