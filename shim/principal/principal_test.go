package principal

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"
)

func writeTree(t *testing.T, files map[string]string) string {
	t.Helper()
	root := t.TempDir()
	for p, body := range files {
		full := filepath.Join(root, p)
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(full, []byte(body), 0o640); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// A cloud image's accounts: ubuntu is a sudoer through cloud-init's file
// and the sudo group, ops only through a %group rule in an included file,
// dev can run one command, alice is in the docker group, bob in nothing.
var hostFiles = map[string]string{
	"/etc/passwd": `root:x:0:0:root:/root:/bin/bash
nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin
ubuntu:x:1000:1000::/home/ubuntu:/bin/bash
alice:x:1001:1001::/home/alice:/bin/bash
bob:x:1002:1002::/home/bob:/bin/bash
ops:x:1003:1003::/home/ops:/bin/bash
dev:x:1004:1004::/home/dev:/bin/bash
riftuser:x:1005:1005::/home/riftuser:/bin/bash
carol:x:1006:1006::/home/carol:/bin/bash
lab:x:1007:1007::/home/lab:/bin/bash
`,
	"/etc/group": `root:x:0:
sudo:x:27:ubuntu
docker:x:998:alice
nogroup:x:65534:
ubuntu:x:1000:
alice:x:1001:
bob:x:1002:
gpuops:x:1003:
dev:x:1004:
riftuser:x:1005:
carol:x:1006:
lab:x:1007:
`,
	"/etc/sudoers": `Defaults	env_reset
# User privilege specification
root	ALL=(ALL:ALL) ALL
%sudo	ALL=(ALL:ALL) ALL
User_Alias ADMINS = carol, \
   nobody2
ADMINS ALL = (root) NOPASSWD: ALL
@includedir /etc/sudoers.d
`,
	"/etc/sudoers.d/90-cloud-init-users": "# Created by cloud-init\nubuntu ALL=(ALL) NOPASSWD:ALL\nriftuser ALL=(ALL) NOPASSWD:ALL\n",
	"/etc/sudoers.d/ops":                 "%gpuops ALL=(ALL) NOPASSWD: ALL\n",
	"/etc/sudoers.d/dev":                 "dev ALL=(root) /usr/bin/systemctl restart foo\ndev ALL=(postgres) ALL\n",
	"/etc/sudoers.d/old.bak":             "bob ALL=(ALL) ALL\n", // sudo skips names with a dot
}

func TestDecide(t *testing.T) {
	root := writeTree(t, hostFiles)
	p := &Policy{Root: root, DockerSocket: "/run/docker.sock", Allow: []string{"lab", "4242"}}
	// The Docker socket: group docker (998), group-writable.
	sock := filepath.Join(root, "run", "docker.sock")
	if err := os.MkdirAll(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(sock, nil, 0o660); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(sock, 0, 998); err != nil {
		t.Skip("chown needs root:", err)
	}
	if err := os.Chmod(sock, 0o660); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		uid  uint32
		want bool
		why  string
	}{
		{0, true, "root"},
		{1000, true, "sudoers grants ALL"},      // ubuntu: sudo group and cloud-init's file
		{1005, true, "NOPASSWD:ALL"},            // riftuser: cloud-init's file only
		{1003, true, "%gpuops"},                 // ops: its primary group, in an included file
		{1006, true, "ADMINS"},                  // carol: a User_Alias across a continuation
		{1001, true, "Docker socket's group"},   // alice
		{1007, true, "allowed by the operator"}, // lab by name
		{4242, true, "allowed by the operator"}, // a uid with no passwd entry
		{1002, false, "not root-equivalent"},    // bob: only a skipped file names him
		{1004, false, "not root-equivalent"},    // dev: one command, or ALL as postgres
		{65534, false, "not root-equivalent"},   // nobody
		{31337, false, "not root-equivalent"},   // unknown
	} {
		d := p.Decide(c.uid)
		if d.Allowed != c.want || !strings.Contains(d.Why, c.why) {
			t.Errorf("uid %d: %+v, want allowed=%v with %q", c.uid, d, c.want, c.why)
		}
	}
	if d := p.Decide(1002); !strings.Contains(d.Error(), "uid 1002 (bob)") {
		t.Errorf("refusal names the account: %q", d.Error())
	}
	got := p.AllowedUIDs()
	slices.Sort(got)
	if want := []uint32{0, 1000, 1001, 1003, 1005, 1006, 1007, 4242}; !slices.Equal(got, want) {
		t.Errorf("AllowedUIDs = %v, want %v", got, want)
	}
}

// TestDecideFollowsTheHost: answers are kept for the TTL, then the host's
// files are read again (a user added to sudo is admitted, a removed one
// refused).
func TestDecideFollowsTheHost(t *testing.T) {
	root := writeTree(t, hostFiles)
	now := time.Unix(1000, 0)
	p := &Policy{Root: root, DockerSocket: "-", TTL: 5 * time.Second, Now: func() time.Time { return now }}
	if p.Decide(1002).Allowed {
		t.Fatal("bob allowed")
	}
	grp := strings.Replace(hostFiles["/etc/group"], "sudo:x:27:ubuntu", "sudo:x:27:ubuntu,bob", 1)
	if err := os.WriteFile(filepath.Join(root, "etc", "group"), []byte(grp), 0o644); err != nil {
		t.Fatal(err)
	}
	if p.Decide(1002).Allowed {
		t.Fatal("the cached answer should hold for its TTL")
	}
	now = now.Add(6 * time.Second)
	if !p.Decide(1002).Allowed {
		t.Fatal("bob, now in sudo, refused after the TTL")
	}
}

// TestDockerGroupOnlyWhenWritable: a socket the group cannot write grants
// nothing; neither does a socket owned by group root.
func TestDockerGroupOnlyWhenWritable(t *testing.T) {
	root := writeTree(t, hostFiles)
	sock := filepath.Join(root, "docker.sock")
	if err := os.WriteFile(sock, nil, 0o640); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(sock, 0, 998); err != nil {
		t.Skip("chown needs root:", err)
	}
	p := &Policy{Root: root, DockerSocket: "/docker.sock"}
	if p.Decide(1001).Allowed {
		t.Fatal("a read-only socket group admitted alice")
	}
}

func TestGrantsAll(t *testing.T) {
	for spec, want := range map[string]bool{
		"(ALL:ALL) ALL":                 true,
		"(ALL) NOPASSWD:ALL":            true,
		" (root) NOPASSWD: SETENV: ALL": true,
		"ALL":                           true,
		"(root) /bin/ls, ALL":           true,
		"(postgres) ALL":                false,
		"(root) /usr/bin/apt":           false,
		"(ALL) !ALL":                    false,
		"":                              false,
	} {
		if got := grantsAll(spec); got != want {
			t.Errorf("grantsAll(%q) = %v, want %v", spec, got, want)
		}
	}
}

func FuzzSudoers(f *testing.F) {
	f.Add(hostFiles["/etc/sudoers"])
	f.Add("ADMINS ALL = (root) NOPASSWD: ALL\n@include x\n#includedir /etc/sudoers.d\n")
	f.Fuzz(func(t *testing.T, body string) {
		root := t.TempDir()
		_ = os.MkdirAll(filepath.Join(root, "etc"), 0o755)
		_ = os.WriteFile(filepath.Join(root, "etc", "sudoers"), []byte(body), 0o644)
		p := &Policy{Root: root}
		r, _ := p.sudoRules()
		_, _ = r.grants(account{uid: 5, name: "x", groups: map[string]bool{"g": true}, gids: map[uint32]bool{5: true}})
	})
}

// TestIncludesNeverBlockOrEscape: an include naming a FIFO is skipped
// without blocking, and an include climbing out of Root stays inside it.
func TestIncludesNeverBlockOrEscape(t *testing.T) {
	root := writeTree(t, map[string]string{
		"/etc/passwd":  "x:x:5:5::/:/bin/sh\n",
		"/etc/group":   "x:x:5:\n",
		"/etc/sudoers": "@includedir /etc/sudoers.d\n@include /../../../../etc/sudoers.local\n",
		// Inside Root, where the climbing include lands.
		"/etc/sudoers.local": "x ALL=(ALL) ALL\n",
	})
	if err := os.MkdirAll(filepath.Join(root, "etc", "sudoers.d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(filepath.Join(root, "etc", "sudoers.d", "pipe"), 0o644); err != nil {
		t.Fatal(err)
	}
	done := make(chan Decision, 1)
	go func() { done <- (&Policy{Root: root, DockerSocket: "-"}).Decide(5) }()
	select {
	case d := <-done:
		if !d.Allowed {
			t.Fatalf("the include inside Root was not read: %+v", d)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("a FIFO in sudoers.d blocked the decision")
	}
}
