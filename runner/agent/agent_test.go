package agent

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// TestRunWithoutJob runs the whole runner: it serves, and when no job
// comes within the start timeout it returns ErrNoJob, with its log in its
// temp dir.
func TestRunWithoutJob(t *testing.T) {
	t.Setenv("HOME", os.Getenv("HOME")) // Run may correct it
	dir := t.TempDir()
	var out bytes.Buffer
	err := Run(context.Background(), Config{TempDir: dir, DstackDir: filepath.Join(dir, "dstack"), HTTPAddress: "127.0.0.1",
		SSHAddress: "127.0.0.1", LogLevel: slog.LevelInfo, SSHLogLevel: slog.LevelError,
		StartTimeout: 300 * time.Millisecond, Stdout: &out})
	if !errors.Is(err, ErrNoJob) {
		t.Fatalf("Run: %v", err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "default.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"runner API serving", "ssh server serving", "Job didn't start in time"} {
		if !bytes.Contains(b, []byte(want)) {
			t.Errorf("default.log lacks %q:\n%s", want, b)
		}
	}
	if !bytes.Equal(b, out.Bytes()) {
		t.Errorf("console and default.log differ:\n%s\n---\n%s", out.Bytes(), b)
	}
}

// localhost is listened on as 127.0.0.1, whatever the resolver's files
// say (a container's /etc/hosts may map it elsewhere, or be missing).
func TestListenLocalhostIsTheLoopback(t *testing.T) {
	for _, host := range []string{"localhost", "LocalHost"} {
		ln, err := listen(net.JoinHostPort(host, "0"))
		if err != nil {
			t.Fatal(err)
		}
		addr := ln.Addr().(*net.TCPAddr)
		ln.Close()
		if !addr.IP.Equal(net.IPv4(127, 0, 0, 1)) {
			t.Fatalf("%s: listened on %s, want 127.0.0.1", host, addr)
		}
	}
}
