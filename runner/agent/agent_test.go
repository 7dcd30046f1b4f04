package agent

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/tandem-run/tandem/e2e/testenv"
)

// TestRunWithoutJob runs the whole runner: it serves, and when no job
// comes within the start timeout it returns ErrNoJob, with its log in its
// temp dir.
func TestRunWithoutJob(t *testing.T) {
	t.Setenv("HOME", os.Getenv("HOME")) // Run may correct it
	dir := t.TempDir()
	var out bytes.Buffer
	// Ports of its own: the defaults (10999, 10022) are a host-network
	// runner's, which the e2e suite beside it may be running.
	err := Run(context.Background(), Config{TempDir: dir, DstackDir: filepath.Join(dir, "dstack"), HTTPAddress: "127.0.0.1", HTTPPort: testenv.FreePort(t),
		SSHAddress: "127.0.0.1", SSHPort: testenv.FreePort(t), LogLevel: slog.LevelInfo, SSHLogLevel: slog.LevelError,
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

// Once the API answers, the SSH port takes connections: a client that saw
// the runner healthy is never refused (the port is bound before the API
// serves; the connection waits in the backlog for the server).
func TestSSHPortIsBoundBeforeTheAPIAnswers(t *testing.T) {
	t.Setenv("HOME", os.Getenv("HOME"))
	dir := t.TempDir()
	httpPort, sshPort := testenv.FreePort(t), testenv.FreePort(t)
	done := make(chan error, 1)
	go func() {
		done <- Run(context.Background(), Config{TempDir: dir, DstackDir: filepath.Join(dir, "dstack"), HTTPAddress: "127.0.0.1", HTTPPort: httpPort,
			SSHAddress: "127.0.0.1", SSHPort: sshPort, LogLevel: slog.LevelError, SSHLogLevel: slog.LevelError,
			StartTimeout: 3 * time.Second, Stdout: io.Discard})
	}()
	deadline := time.Now().Add(10 * time.Second)
	for {
		c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(httpPort)))
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the API never listened: %v", err)
		}
		// No sleep: the dial right after the API's first answer is the
		// one a gap would refuse.
	}
	c, err := net.Dial("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(sshPort)))
	if err != nil {
		t.Fatalf("the API listens but SSH refused: %v", err)
	}
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	banner, err := bufio.NewReader(c).ReadString('\n')
	c.Close()
	if !strings.HasPrefix(banner, "SSH-2.0-") {
		t.Fatalf("banner %q (%v)", banner, err)
	}
	if err := <-done; !errors.Is(err, ErrNoJob) {
		t.Fatalf("Run: %v", err)
	}
}
