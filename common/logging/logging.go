// Package logging sets up log/slog the way both agents need it: dstack's level
// names and digits, and one logger writing to several sinks.
package logging

import (
	"context"
	"fmt"
	"io"
	"log/slog"
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

// Format is how log lines are written.
type Format string

// Formats: logfmt-style text (dstack's), or one JSON object per line.
const (
	FormatText Format = "text"
	FormatJSON Format = "json"
)

// ParseFormat accepts "text" (or "") and "json".
func ParseFormat(s string) (Format, error) {
	switch strings.ToLower(s) {
	case "", "text", "logfmt":
		return FormatText, nil
	case "json":
		return FormatJSON, nil
	}
	return "", fmt.Errorf("unknown log format %q (text or json)", s)
}

// New returns a text logger at level writing to every w. A failing sink does
// not stop the others.
func New(level slog.Leveler, w ...io.Writer) *slog.Logger {
	return NewFormat(level, FormatText, w...)
}

// NewFormat is New in the given format.
func NewFormat(level slog.Leveler, format Format, w ...io.Writer) *slog.Logger {
	var out io.Writer = io.Discard
	switch len(w) {
	case 0:
	case 1:
		out = w[0]
	default:
		out = tee(w)
	}
	opts := &slog.HandlerOptions{
		Level: level,
		ReplaceAttr: func(_ []string, a slog.Attr) slog.Attr {
			if a.Key == slog.LevelKey {
				if l, ok := a.Value.Any().(slog.Level); ok {
					a.Value = slog.StringValue(LevelName(l))
				}
			}
			return a
		},
	}
	if format == FormatJSON {
		return slog.New(slog.NewJSONHandler(out, opts))
	}
	return slog.New(slog.NewTextHandler(out, opts))
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
// directory is created), rotated by size (see Rotating); close the returned
// file when done.
func ToFile(level slog.Leveler, format Format, console io.Writer, path string) (*slog.Logger, io.Closer, error) {
	f, err := OpenRotating(path, DefaultMaxBytes, DefaultKeep)
	if err != nil {
		return nil, nil, err
	}
	return NewFormat(level, format, console, f), f, nil
}

// AtLevel returns a logger that writes l's records at level and above. It
// can only be quieter than what l's handler lets through: build l at the
// most verbose level any of its derived loggers needs.
func AtLevel(l *slog.Logger, level slog.Leveler) *slog.Logger {
	return slog.New(levelFilter{h: l.Handler(), min: level})
}

type levelFilter struct {
	h   slog.Handler
	min slog.Leveler
}

func (f levelFilter) Enabled(ctx context.Context, l slog.Level) bool {
	return l >= f.min.Level() && f.h.Enabled(ctx, l)
}
func (f levelFilter) Handle(ctx context.Context, r slog.Record) error { return f.h.Handle(ctx, r) }
func (f levelFilter) WithAttrs(a []slog.Attr) slog.Handler {
	return levelFilter{h: f.h.WithAttrs(a), min: f.min}
}
func (f levelFilter) WithGroup(g string) slog.Handler {
	return levelFilter{h: f.h.WithGroup(g), min: f.min}
}
