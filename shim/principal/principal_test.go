package principal

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
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

// TestDecideWithoutSudo: a fixture Root has no sudo of its own, so only
// root, the Docker socket's group and the operator's list admit; the
// sudoers files in the tree grant nothing (TestSudoDecides asks the real
// sudo about them).
func TestDecideWithoutSudo(t *testing.T) {
	root := writeTree(t, hostFiles)
	p := &Policy{Root: root, DockerSocket: "/run/docker.sock", Allow: []string{"lab", "4242", "@gpuops"}}
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
		{1001, true, "Docker socket's group"},                  // alice
		{1007, true, "allowed by the operator"},                // lab by name
		{4242, true, "allowed by the operator"},                // a uid with no passwd entry
		{1003, true, "allowed by the operator (group gpuops)"}, // ops: its primary group
		{1000, false, "not root-equivalent"},                   // ubuntu: sudoers, but no sudo here
		{1002, false, "not root-equivalent"},                   // bob
		{65534, false, "not root-equivalent"},                  // nobody
		{31337, false, "not root-equivalent"},                  // unknown
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
	if want := []uint32{0, 1001, 1003, 1007, 4242}; !slices.Equal(got, want) {
		t.Errorf("AllowedUIDs = %v, want %v", got, want)
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
