package agent

import (
	"bytes"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestWarnEphemeralPorts(t *testing.T) {
	dir := t.TempDir()
	hostRange := filepath.Join(dir, "range")
	if err := os.WriteFile(hostRange, []byte("20000\t30000\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	warned := func(file string, ports map[string]int) string {
		var buf bytes.Buffer
		warnEphemeralPorts(slog.New(slog.NewTextHandler(&buf, nil)), file, ports)
		return buf.String()
	}
	// dstack's defaults are below both ranges.
	if out := warned(hostRange, map[string]int{"runner-http-port": 10999, "runner-ssh-port": 10022}); out != "" {
		t.Fatalf("warned for the default ports: %s", out)
	}
	// In the host's range only, in a new namespace's only, in neither.
	out := warned(hostRange, map[string]int{"runner-http-port": 25000, "runner-ssh-port": 40000})
	if !strings.Contains(out, "flag=runner-http-port port=25000 range=20000-30000") || !strings.Contains(out, "flag=runner-ssh-port port=40000 range=32768-60999") {
		t.Fatalf("want both ports warned with their range:\n%s", out)
	}
	if n := strings.Count(out, "level=WARN"); n != 2 {
		t.Fatalf("%d warnings, want 2:\n%s", n, out)
	}
	// No host file: the namespace default still applies.
	if out := warned(filepath.Join(dir, "missing"), map[string]int{"runner-http-port": 32768}); !strings.Contains(out, "port=32768") {
		t.Fatalf("no warning without the host's range file:\n%s", out)
	}
}
