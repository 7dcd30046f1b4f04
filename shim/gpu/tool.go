package gpu

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os/exec"
	"path/filepath"
	"time"
)

// errToolOutput says a vendor tool wrote more than its answer can be.
var errToolOutput = errors.New("answer too long")

// capped is a writer that keeps at most max bytes and then fails the
// write, which ends the tool (its pipe breaks): a tool that floods is not
// read to its end.
type capped struct {
	buf bytes.Buffer
	max int
}

func (c *capped) Write(p []byte) (int, error) {
	if c.buf.Len()+len(p) > c.max {
		return 0, fmt.Errorf("%w: over %d bytes", errToolOutput, c.max)
	}
	return c.buf.Write(p)
}

// runTool runs a vendor tool with a timeout and bounded output (stdout up
// to max, stderr 4 KiB for the error) and returns its stdout.
func runTool(ctx context.Context, timeout time.Duration, max int, name string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	out, errOut := &capped{max: max}, &capped{max: 4 << 10}
	cmd.Stdout, cmd.Stderr = out, errOut
	cmd.WaitDelay = time.Second // a child holding the pipe does not hold us
	err := cmd.Run()
	switch {
	case errors.Is(err, exec.ErrNotFound):
		return nil, fmt.Errorf("%s: not installed", name)
	case ctx.Err() != nil:
		return nil, fmt.Errorf("%s: no answer in %s", name, timeout)
	case out.buf.Len() >= max || errors.Is(err, errToolOutput):
		return nil, fmt.Errorf("%s: %w", name, errToolOutput)
	case err != nil:
		return nil, fmt.Errorf("%s: %w: %s", name, err, boundedLine(errOut.buf.String()))
	}
	return out.buf.Bytes(), nil
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
