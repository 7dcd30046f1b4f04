// Package logging sets up log/slog the way both agents need it: dstack's level
// names and digits, and one logger writing to several sinks.
package logging

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
)

// Extra levels dstack has and slog does not.
const (
	LevelTrace = slog.LevelDebug - 4
	LevelFatal = slog.LevelError + 4
)

// ParseLevel accepts dstack's names (fatal, error, warn, warning, info, debug,
// trace; any case) and the digits 1..6 (1 = fatal ... 6 = trace).
func ParseLevel(s string) (slog.Level, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "1", "fatal":
		return LevelFatal, nil
	case "2", "error":
		return slog.LevelError, nil
	case "3", "warn", "warning":
		return slog.LevelWarn, nil
	case "4", "info":
		return slog.LevelInfo, nil
	case "5", "debug":
		return slog.LevelDebug, nil
	case "6", "trace":
		return LevelTrace, nil
	}
	return 0, fmt.Errorf("invalid log level %q: want fatal, error, warn, info, debug, trace or 1..6", s)
}

// LevelName returns dstack's name for l.
func LevelName(l slog.Level) string {
	switch {
	case l <= LevelTrace:
		return "trace"
	case l <= slog.LevelDebug:
		return "debug"
	case l <= slog.LevelInfo:
		return "info"
	case l <= slog.LevelWarn:
		return "warning"
	case l <= slog.LevelError:
		return "error"
	}
	return "fatal"
}

// New returns a text logger at level writing to every w. A failing sink does
// not stop the others.
func New(level slog.Leveler, w ...io.Writer) *slog.Logger {
	var out io.Writer = io.Discard
	switch len(w) {
	case 0:
	case 1:
		out = w[0]
	default:
		out = tee(w)
	}
	h := slog.NewTextHandler(out, &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.LevelKey {
				if l, ok := a.Value.Any().(slog.Level); ok {
					a.Value = slog.StringValue(LevelName(l))
				}
			}
			return a
		},
	})
	return slog.New(h)
}

// tee writes to every writer, reporting success if any accepted the bytes.
type tee []io.Writer

func (t tee) Write(p []byte) (int, error) {
	var firstErr error
	ok := false
	for _, w := range t {
		if _, err := w.Write(p); err != nil {
			if firstErr == nil {
				firstErr = err
			}
			continue
		}
		ok = true
	}
	if ok {
		return len(p), nil
	}
	return 0, firstErr
}

// Discard is a logger that drops everything, for tests and defaults.
func Discard() *slog.Logger { return slog.New(discardHandler{}) }

type discardHandler struct{}

func (discardHandler) Enabled(context.Context, slog.Level) bool  { return false }
func (discardHandler) Handle(context.Context, slog.Record) error { return nil }
func (d discardHandler) WithAttrs([]slog.Attr) slog.Handler      { return d }
func (d discardHandler) WithGroup(string) slog.Handler           { return d }

// ToFile returns a logger writing to console and appending to path (its
// directory is created); close the returned file when done.
func ToFile(level slog.Leveler, console io.Writer, path string) (*slog.Logger, io.Closer, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, nil, fmt.Errorf("log dir: %w", err)
	}
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, nil, fmt.Errorf("log file: %w", err)
	}
	return New(level, console, f), f, nil
}
