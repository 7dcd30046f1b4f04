package principal

import (
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/common/procs"
)

// The accounts of TestSudoDecides. Each name says the shape of its grant.
const sudoPasswd = `root:x:0:0:root:/root:/bin/sh
full:x:1100:1100::/:/bin/sh
cloud:x:1101:1101::/:/bin/sh
onlygroup:x:1102:1102::/:/bin/sh
otherhost:x:1103:1103::/:/bin/sh
lastdeny:x:1104:1104::/:/bin/sh
comma:x:1105:1105::/:/bin/sh
worldw:x:1106:1106::/:/bin/sh
ownfile:x:1107:1107::/:/bin/sh
runasalias:x:1108:1108::/:/bin/sh
byuid:x:1109:1109::/:/bin/sh
narrow:x:1110:1110::/:/bin/sh
primary:x:1111:2000::/:/bin/sh
member:x:1112:1112::/:/bin/sh
postgres:x:1113:1113::/:/bin/sh
dotfile:x:1114:1114::/:/bin/sh
alias:x:1115:1115::/:/bin/sh
bygid:x:1116:2001::/:/bin/sh
later:x:1117:1117::/:/bin/sh
docker1:x:1118:1118::/:/bin/sh
nobody:x:65534:65534::/nonexistent:/usr/sbin/nologin
`

const sudoGroup = `root:x:0:
admins:x:2000:member
ops:x:2001:
docker:x:998:docker1
nogroup:x:65534:
`

// sudoSudoers is the main file; the attacker's rows come from the issue
// (each was admitted by the parser this replaced, or refused though sudo
// grants it).
const sudoSudoers = `Defaults env_reset
root ALL=(ALL:ALL) ALL
full ALL=(ALL:ALL) ALL
onlygroup ALL=(:admins) ALL
otherhost not-this-host = (ALL) ALL
lastdeny ALL=(ALL) ALL
lastdeny ALL=(ALL) !ALL
comma ALL=(root) /usr/bin/printf a\,b
Runas_Alias R = root
runasalias ALL=(R) ALL
#1109 ALL=(ALL) ALL
narrow ALL=(root) NOPASSWD: /usr/bin/id
%admins ALL=(ALL) ALL
%#2001 ALL=(ALL) ALL
postgres ALL=(postgres) ALL
User_Alias ADMINS = nobody2, \
   alias
ADMINS ALL = (root) NOPASSWD: ALL
@includedir /etc/sudoers.d
`

// TestSudoDecides holds every shape of grant against the real sudo: the
// test re-runs itself in a mount namespace of its own where the fixture's
// passwd, group, sudoers and sudoers.d are bound over the host's, so sudo
// reads them and nothing of the machine changes.
func TestSudoDecides(t *testing.T) {
	if dir := os.Getenv("TANDEM_PRINCIPAL_SUDO_FIXTURE"); dir != "" {
		sudoTable(t, dir)
		return
	}
	if _, err := (&Policy{}).sudoPath(); err != nil || os.Geteuid() != 0 {
		if os.Getenv("CI") == "true" {
			t.Fatalf("CI needs root and sudo (make deps installs it): euid %d, %v", os.Geteuid(), err)
		}
		t.Skip("needs root and sudo")
	}
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		t.Fatal("unshare (util-linux) missing")
	}
	dir := t.TempDir()
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	write := func(name, body string, mode os.FileMode, uid int) {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(body), mode); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil { // past the umask
			t.Fatal(err)
		}
		if err := os.Chown(p, uid, 0); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Mkdir(filepath.Join(dir, "sudoers.d"), 0o755); err != nil {
		t.Fatal(err)
	}
	write("passwd", sudoPasswd, 0o644, 0)
	write("group", sudoGroup, 0o644, 0)
	// sudo looks up the host's name on every run: the fixture's name is in
	// hosts, or each run asks DNS, and a lost query is a 5 s wait that
	// turns a grant into a timeout (one run in ten here).
	write("hosts", "127.0.0.1 localhost\n127.0.1.1 tandem-sudo-fixture\n", 0o644, 0)
	write("sudoers", sudoSudoers, 0o440, 0)
	write("sudoers.d/90-cloud-init-users", "# Created by cloud-init\ncloud ALL=(ALL) NOPASSWD:ALL\n", 0o440, 0)
	// sudo ignores a world-writable file and one its account owns: any
	// local account could write itself into the first.
	write("sudoers.d/worldw", "worldw ALL=(ALL) NOPASSWD:ALL\n", 0o666, 0)
	write("sudoers.d/ownfile", "ownfile ALL=(ALL) NOPASSWD:ALL\n", 0o440, 1107)
	write("sudoers.d/old.bak", "dotfile ALL=(ALL) ALL\n", 0o440, 0) // a name with a dot: skipped
	write("sudoers.d/later", "", 0o440, 0)                          // TestSudoDecides's child writes into it
	write("docker.sock", "", 0o660, 0)
	if err := os.Chown(filepath.Join(dir, "docker.sock"), 0, 998); err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(unshare, "--mount", "--uts", "--propagation", "private", "--",
		os.Args[0], "-test.run", "^TestSudoDecides$", "-test.count", "1", "-test.v")
	cmd.Env = append(os.Environ(), "TANDEM_PRINCIPAL_SUDO_FIXTURE="+dir)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestSudoDecides") {
		t.Fatalf("the table against sudo: %v\n%s", err, out)
	}
	t.Logf("%s", out)
}

// sudoTable is TestSudoDecides inside its mount namespace.
func sudoTable(t *testing.T, dir string) {
	for _, f := range []string{"passwd", "group", "hosts", "sudoers", "sudoers.d"} {
		if err := syscall.Mount(filepath.Join(dir, f), "/etc/"+f, "", syscall.MS_BIND, ""); err != nil {
			t.Fatalf("bind %s: %v", f, err)
		}
	}
	if err := syscall.Sethostname([]byte("tandem-sudo-fixture")); err != nil {
		t.Fatal(err)
	}
	now := time.Unix(1000, 0)
	p := &Policy{DockerSocket: filepath.Join(dir, "docker.sock"), Allow: []string{"4242"}, Now: func() time.Time { return now }}
	for _, c := range []struct {
		name string
		uid  uint32
		want bool
		why  string
	}{
		{"root", 0, true, "root"},
		{"a full sudoer", 1100, true, "sudo lets it run a shell"},
		{"cloud-init's NOPASSWD:ALL in sudoers.d", 1101, true, "sudo"},
		{"(:group) runs as oneself with another group", 1102, false, "not root-equivalent"},
		{"a rule for another host", 1103, false, "not root-equivalent"},
		{"a later !ALL (the last match wins)", 1104, false, "not root-equivalent"},
		{"an escaped comma in a command's arguments", 1105, false, "not root-equivalent"},
		{"a world-writable file in sudoers.d", 1106, false, "not root-equivalent"},
		{"a sudoers.d file the account owns", 1107, false, "not root-equivalent"},
		{"Runas_Alias R = root, (R) ALL", 1108, true, "sudo"},
		{"#uid ALL=(ALL) ALL", 1109, true, "sudo"},
		{"a narrow NOPASSWD: /usr/bin/id", 1110, false, "not root-equivalent"},
		{"%group through the primary gid", 1111, true, "sudo"},
		{"%group through the member list", 1112, true, "sudo"},
		{"ALL as another user", 1113, false, "not root-equivalent"},
		{"a sudoers.d name with a dot", 1114, false, "not root-equivalent"},
		{"a User_Alias across a continuation", 1115, true, "sudo"},
		{"%#gid", 1116, true, "sudo"},
		{"the Docker socket's group", 1118, true, "Docker socket's group"},
		{"allowed by the operator, no passwd entry", 4242, true, "allowed by the operator"},
		{"nobody", 65534, false, "not root-equivalent"},
		{"no such account", 31337, false, "not root-equivalent"},
	} {
		d := p.Decide(c.uid)
		if d.Allowed != c.want || !strings.Contains(d.Why, c.why) {
			t.Errorf("%s (uid %d): %+v, want allowed=%v with %q", c.name, c.uid, d, c.want, c.why)
		}
	}
	got := p.AllowedUIDs()
	slices.Sort(got)
	if want := []uint32{0, 1100, 1101, 1108, 1109, 1111, 1112, 1115, 1116, 1118, 4242}; !slices.Equal(got, want) {
		t.Errorf("AllowedUIDs = %v, want %v", got, want)
	}

	// The answer is kept for the TTL, then sudo is asked again: an account
	// added to sudo is admitted, and refused again once removed.
	later := filepath.Join(dir, "sudoers.d", "later")
	if p.Decide(1117).Allowed {
		t.Fatal("later admitted before any rule names it")
	}
	if err := os.WriteFile(later, []byte("later ALL=(ALL) ALL\n"), 0o440); err != nil {
		t.Fatal(err)
	}
	if p.Decide(1117).Allowed {
		t.Fatal("the cached refusal should hold for its TTL")
	}
	now = now.Add(6 * time.Second)
	if !p.Decide(1117).Allowed {
		t.Fatal("later, now a sudoer, refused after the TTL")
	}
	if err := os.WriteFile(later, nil, 0o440); err != nil {
		t.Fatal(err)
	}
	now = now.Add(6 * time.Second)
	if p.Decide(1117).Allowed {
		t.Fatal("later, no longer a sudoer, admitted after the TTL")
	}
}

// TestSudoThatDoesNotAnswer: a sudo that hangs (a directory server that
// never answers) or answers something else is a refusal, within the
// timeout, and its processes are gone.
func TestSudoThatDoesNotAnswer(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pid")
	hang := filepath.Join(dir, "hang")
	if err := os.WriteFile(hang, []byte("#!/bin/sh\nsleep 60 &\necho $! > "+pidFile+"\nwait\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	odd := filepath.Join(dir, "odd")
	if err := os.WriteFile(odd, []byte("#!/bin/sh\necho /bin/bash\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	root := writeTree(t, hostFiles)
	p := &Policy{Root: root, DockerSocket: "-", Sudo: hang, SudoTimeout: 300 * time.Millisecond}
	done := make(chan Decision, 1)
	go func() { done <- p.Decide(1000) }()
	select {
	case d := <-done:
		if d.Allowed || !strings.Contains(d.Why, "sudo did not answer") {
			t.Fatalf("a hanging sudo: %+v", d)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("a hanging sudo hung the decision")
	}
	if b, err := os.ReadFile(pidFile); err == nil {
		pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
		if pid > 0 && !gone(pid, 5*time.Second) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Errorf("the hanging sudo's child (pid %d) was left running", pid)
		}
	}
	p = &Policy{Root: root, DockerSocket: "-", Sudo: odd}
	if d := p.Decide(1000); d.Allowed || !strings.Contains(d.Why, "not /bin/sh") {
		t.Fatalf("a sudo answering another command: %+v", d)
	}
}

// gone waits up to d for pid to be gone or a zombie (dead, waiting for
// whoever reaps orphans here).
func gone(pid int, d time.Duration) bool {
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if f, err := procs.StatFields(filepath.Join("/proc", strconv.Itoa(pid))); err != nil || f[0] == "Z" {
			return true
		}
	}
	return false
}
