package cloudinit

import (
	"flag"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite golden files")

const testKey = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGa6ZRd7ZG7JXqZbWbKJ3b7h5pI6kY0cUQYvV0c8m1pF user@laptop"

func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		_ = os.WriteFile(path, []byte(got), 0o644)
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (go test ./cloudinit -update)", err)
	}
	if got != string(want) {
		t.Fatalf("%s drifted:\n%s", path, got)
	}
}

func shellcheck(t *testing.T, script, shell string) {
	t.Helper()
	if _, err := exec.LookPath("shellcheck"); err != nil {
		t.Skip("shellcheck not installed (make deps installs it)")
	}
	cmd := exec.Command("shellcheck", "-s", shell, "-")
	cmd.Stdin = strings.NewReader(script)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("shellcheck: %v\n%s", err, out)
	}
}

func TestEntrypointRender(t *testing.T) {
	e := Entrypoint{RunnerURL: "https://example.com/tandem/0.1.0/dstack-runner-linux-amd64",
		RunnerSHA256: strings.Repeat("ab", 32), AuthorizedKeys: []string{testKey, testKey}}
	s, err := e.Render()
	if err != nil {
		t.Fatal(err)
	}
	golden(t, "entrypoint.sh", s)
	if len(s) >= 2048 {
		t.Fatalf("entrypoint is %d bytes; providers cap commands near 2 KB", len(s))
	}
	shellcheck(t, s, "sh")
	if !strings.Contains(s, "--ssh-authorized-key '"+testKey+"' --ssh-authorized-key") {
		t.Fatal("keys")
	}
	// Every download command gets the URL as its own word.
	for _, line := range strings.Split(s, "\n") {
		if strings.Contains(line, `"$U"`) && !strings.Contains(line, `"$U" `) && !strings.HasSuffix(strings.TrimSuffix(line, "&&return"), `"$U"`) {
			t.Fatalf("URL glued to the next word: %s", line)
		}
	}
}

func TestEntrypointBadInput(t *testing.T) {
	good := Entrypoint{RunnerURL: "http://h/r", AuthorizedKeys: []string{testKey}}
	tests := []struct {
		mod  func(*Entrypoint)
		want string
	}{
		{func(e *Entrypoint) { e.RunnerURL = "" }, "runner_url: required"},
		{func(e *Entrypoint) { e.RunnerURL = "ftp://h/r" }, "runner_url: "},
		{func(e *Entrypoint) { e.RunnerURL = "http://h/r'; rm -rf /" }, "runner_url: "},
		{func(e *Entrypoint) { e.RunnerSHA256 = "xyz" }, "runner_sha256: "},
		{func(e *Entrypoint) { e.AuthorizedKeys = nil }, "authorized_keys: at least one"},
		{func(e *Entrypoint) { e.AuthorizedKeys = []string{"not a key"} }, "authorized_keys[0]: not an SSH public key"},
		{func(e *Entrypoint) { e.SSHPort = 70000 }, "ssh_port: 70000"},
		{func(e *Entrypoint) { e.Path = "relative/runner" }, "path: "},
	}
	for _, tc := range tests {
		e := good
		tc.mod(&e)
		if _, err := e.Render(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("want %q, got %v", tc.want, err)
		}
	}
}

// TestEntrypointHostileURL runs the rendered script's fetch fallbacks (no
// curl, no wget: bash's /dev/tcp, then nc) with a URL full of shell syntax.
// Validate refuses it; the script itself must not act on it either, so it
// is rendered here past the check.
func TestEntrypointHostileURL(t *testing.T) {
	dir := t.TempDir()
	marker := filepath.Join(dir, "INJECTED")
	for i, hostile := range []string{
		"http://127.0.0.1:9/a;>" + marker + ";",
		"http://127.0.0.1:9/a;touch${IFS}" + marker + "2",
	} {
		if _, err := (Entrypoint{RunnerURL: hostile, AuthorizedKeys: []string{testKey}}).Render(); err == nil {
			t.Fatalf("Validate accepted %q", hostile)
		}
		runHostile(t, dir, hostile, []string{marker, marker + "2"}[i])
	}
}

func runHostile(t *testing.T, dir, hostile, marker string) {
	e := Entrypoint{RunnerURL: hostile, AuthorizedKeys: []string{testKey}, Path: filepath.Join(dir, "bin", "runner")}
	e.defaults()
	var b strings.Builder
	if err := entrypointTmpl.Execute(&b, e); err != nil {
		t.Fatal(err)
	}
	// A PATH with the tools the script needs and neither curl nor wget; a
	// sleep that returns at once.
	bin := filepath.Join(dir, "tools")
	if err := os.MkdirAll(bin, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tool := range []string{"mkdir", "head", "grep", "tail", "rm", "chmod", "cat", "nc", "touch"} {
		if p, err := exec.LookPath(tool); err == nil {
			_ = os.Symlink(p, filepath.Join(bin, tool)) // a second call finds it there
		}
	}
	_ = os.WriteFile(filepath.Join(bin, "sleep"), []byte("#!/bin/sh\nexit 0\n"), 0o755)
	for _, withBash := range []bool{true, false} {
		script := b.String()
		if !withBash {
			script = strings.ReplaceAll(script, "[ -x /bin/bash ]", "false")
		}
		cmd := exec.Command("/bin/sh", "-c", script)
		cmd.Env = []string{"PATH=" + bin}
		out, err := cmd.CombinedOutput()
		if err == nil || !strings.Contains(string(out), "tandem: cannot download") {
			t.Fatalf("bash=%v: %v %s", withBash, err, out)
		}
		if _, err := os.Stat(marker); err == nil {
			t.Fatalf("bash=%v: the URL %q ran as code: %s exists", withBash, hostile, marker)
		}
	}
}
