package logging

import (
	"bytes"
	"errors"
	"log/slog"
	"strings"
	"testing"
)

func TestParseLevel(t *testing.T) {
	tests := []struct {
		in      string
		want    slog.Level
		wantErr bool
	}{
		{"fatal", LevelFatal, false}, {"1", LevelFatal, false},
		{"ERROR", slog.LevelError, false}, {"2", slog.LevelError, false},
		{"warn", slog.LevelWarn, false}, {"Warning", slog.LevelWarn, false}, {"3", slog.LevelWarn, false},
		{"info", slog.LevelInfo, false}, {"4", slog.LevelInfo, false},
		{"debug", slog.LevelDebug, false}, {"5", slog.LevelDebug, false},
		{"TRACE", LevelTrace, false}, {"6", LevelTrace, false},
		{"0", 0, true}, {"7", 0, true}, {"panic", 0, true}, {"", 0, true}, {"verbose", 0, true},
	}
	for _, tc := range tests {
		got, err := ParseLevel(tc.in)
		if (err != nil) != tc.wantErr {
			t.Errorf("ParseLevel(%q) err = %v, wantErr %v", tc.in, err, tc.wantErr)
			continue
		}
		if err == nil && got != tc.want {
			t.Errorf("ParseLevel(%q) = %v, want %v", tc.in, got, tc.want)
		}
	}
}

type failWriter struct{}

func (failWriter) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestNewWritesAllSinksWithDstackLevelNames(t *testing.T) {
	var a, b bytes.Buffer
	log := New(LevelTrace, &a, failWriter{}, &b)
	log.Log(t.Context(), LevelTrace, "deep", "task_id", "t1")
	log.Warn("careful")
	for _, out := range []string{a.String(), b.String()} {
		if !strings.Contains(out, "level=trace msg=deep task_id=t1") || !strings.Contains(out, "level=warning msg=careful") {
			t.Fatalf("unexpected log output:\n%s", out)
		}
	}
	var c bytes.Buffer
	New(slog.LevelInfo, &c).Debug("hidden")
	if c.Len() != 0 {
		t.Fatalf("debug must be filtered at info: %q", c.String())
	}
}

func TestAtLevel(t *testing.T) {
	var buf bytes.Buffer
	base := New(slog.LevelDebug, &buf)
	main := AtLevel(base, slog.LevelInfo)
	ssh := AtLevel(base, slog.LevelDebug).With("component", "sshd")
	main.Debug("main debug")
	main.Info("main info")
	ssh.Debug("ssh debug")
	quiet := AtLevel(base, slog.LevelError)
	quiet.Warn("quiet warn")
	out := buf.String()
	for _, want := range []string{"main info", "ssh debug", "component=sshd"} {
		if !strings.Contains(out, want) {
			t.Errorf("missing %q in\n%s", want, out)
		}
	}
	for _, not := range []string{"main debug", "quiet warn"} {
		if strings.Contains(out, not) {
			t.Errorf("%q was written:\n%s", not, out)
		}
	}
}
