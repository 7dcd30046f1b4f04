package gpu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/tandem-run/tandem/common/toolrun"
)

// runTool runs a vendor tool with a timeout and bounded output (stdout up
// to max, stderr 4 KiB for the error; toolrun kills it and its children
// when the run ends) and returns its stdout.
func runTool(ctx context.Context, timeout time.Duration, max int, name string, args ...string) ([]byte, error) {
	out, errOut, err := toolrun.Run(ctx, toolrun.Bounds{Timeout: timeout, Stdout: max, Stderr: 4 << 10, WaitDelay: time.Second}, name, args...)
	switch {
	case errors.Is(err, exec.ErrNotFound):
		return nil, fmt.Errorf("%s: not installed", name)
	case err != nil:
		return nil, fmt.Errorf("%w: %s", err, boundedLine(string(errOut)))
	}
	return out, nil
}

// boundedLine is the first line of s, at most 200 bytes (a tool's stderr
// for a log line).
func boundedLine(s string) string {
	if i := bytes.IndexByte([]byte(s), '\n'); i >= 0 {
		s = s[:i]
	}
	if len(s) > 200 {
		s = s[:200]
	}
	return s
}

// moduleVersion is a kernel module's version from sysfs, "" when absent
// or not a version a person would read.
func moduleVersion(root, module string) string {
	v := boundedWord(readTrim(filepath.Join(root, "sys", "module", module, "version")))
	switch v {
	case "N/A", "unknown":
		return ""
	}
	return v
}
