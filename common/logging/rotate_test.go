package logging

import (
	"bytes"
	"encoding/json"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRotatingKeepsBoundedFiles(t *testing.T) {
	path := filepath.Join(t.TempDir(), "shim.log")
	r, err := OpenRotating(path, 100, 2)
	if err != nil {
		t.Fatal(err)
	}
	line := []byte(strings.Repeat("x", 39) + "\n")
	for range 20 {
		if _, err := r.Write(line); err != nil {
			t.Fatal(err)
		}
	}
	r.Close()
	var total int64
	for _, p := range []string{path, path + ".1", path + ".2"} {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		if fi.Size() > 100 {
			t.Fatalf("%s is %d bytes", p, fi.Size())
		}
		total += fi.Size()
	}
	if _, err := os.Stat(path + ".3"); err == nil {
		t.Fatal("more files than kept")
	}
	if total == 0 {
		t.Fatal("nothing written")
	}
}

func TestJSONFormat(t *testing.T) {
	var buf bytes.Buffer
	log := NewFormat(slog.LevelInfo, FormatJSON, &buf)
	log.Warn("pull failed", "task_id", "t1")
	var m map[string]any
	if err := json.Unmarshal(buf.Bytes(), &m); err != nil {
		t.Fatalf("%q: %v", buf.String(), err)
	}
	if m["level"] != "warning" || m["task_id"] != "t1" || m["msg"] != "pull failed" {
		t.Fatalf("%v", m)
	}
	if _, err := ParseFormat("xml"); err == nil {
		t.Fatal("unknown format accepted")
	}
}
