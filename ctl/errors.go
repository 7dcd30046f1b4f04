package ctl

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"

	"github.com/tandem-run/tandem/api"
)

// ErrInterrupted means the caller ended the run early (Run.Stop before the
// job ran, or its context cancelled with this cause).
var ErrInterrupted = errors.New("interrupted")

// interrupted says whether ctx ended with ErrInterrupted as its cause.
func interrupted(ctx context.Context) bool { return errors.Is(context.Cause(ctx), ErrInterrupted) }

// Hint is what a caller can give to get past an error. The library names
// no CLI flags; a front end says how its users give each one.
type Hint int

const (
	HintNone Hint = iota
	// HintRunnerPort: the runner's HTTP port on the host, when the shim
	// does not report it or the runner is not where it says.
	HintRunnerPort
	// HintRunnerSSHPort: the runner's SSH port on the host.
	HintRunnerSSHPort
	// HintBridgeNetwork: run in bridge networking, so that tasks do not
	// share the host's runner ports.
	HintBridgeNetwork
	// HintPortsTaken: a process that is no task holds the runner's ports
	// on the host: stop it, or run in bridge networking.
	HintPortsTaken
	// HintNodeIP: each node's address, when it cannot be found.
	HintNodeIP
	// HintForce: do it although a task is still running.
	HintForce
	// HintBinaries: the agents' binaries to install.
	HintBinaries
	// HintRemoveRunning: a running task is removed once stopped, or when
	// the remove is forced (stopped at once, then removed).
	HintRemoveRunning
)

// HintError is an error a caller can get past as its Hint says.
type HintError struct {
	Hint Hint
	Err  error
}

func (e *HintError) Error() string { return e.Err.Error() }
func (e *HintError) Unwrap() error { return e.Err }

// withHint marks err with h (nil stays nil).
func withHint(h Hint, err error) error {
	if err == nil {
		return nil
	}
	return &HintError{Hint: h, Err: err}
}

// HintOf is the hint err carries, if any.
func HintOf(err error) Hint {
	var he *HintError
	if errors.As(err, &he) {
		return he.Hint
	}
	return HintNone
}

// TaskEndedError is a task that ended before its job started: the shim's
// reason and message.
type TaskEndedError struct {
	Info api.TaskInfoResponse
}

func (e *TaskEndedError) Error() string {
	return "task ended before the job started: " + api.Printable(string(e.Info.TerminationReason)) + ": " + printableLines(e.Info.TerminationMessage)
}

// ShimUnreachableError is a shim address that took no connection (nothing
// listens there, no route, no such host, the SSH tunnel's far end
// refused): every command that reaches a shim says it in these words.
type ShimUnreachableError struct {
	Addr string
	Err  error
}

func (e *ShimUnreachableError) Error() string {
	return fmt.Sprintf("shim at %s is not reachable (%s); is dstack-shim running there?", e.Addr, dialReason(e.Err))
}

func (e *ShimUnreachableError) Unwrap() error { return e.Err }

// dialReason is why a dial failed, in the system's short words
// ("connection refused", "i/o timeout", "no such host").
func dialReason(err error) string {
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return "no such host " + api.Printable(dns.Name)
	}
	var se *os.SyscallError
	if errors.As(err, &se) {
		return se.Err.Error()
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, os.ErrDeadlineExceeded) {
		return "no answer in time"
	}
	var oe *net.OpError
	if errors.As(err, &oe) && oe.Err != nil {
		return strings.TrimSpace(oe.Err.Error())
	}
	return err.Error()
}

// unreachableAs is dial (nil: a plain one) whose failures are the shim at
// addr's *ShimUnreachableError.
func unreachableAs(addr string, dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	if dial == nil {
		var d net.Dialer
		dial = d.DialContext
	}
	return func(ctx context.Context, network, a string) (net.Conn, error) {
		c, err := dial(ctx, network, a)
		if err != nil {
			if ctx.Err() != nil {
				return nil, err // the caller gave up: not the shim's doing
			}
			return nil, &ShimUnreachableError{Addr: addr, Err: err}
		}
		return c, nil
	}
}

// printableLines is msg trimmed, each line made printable.
func printableLines(msg string) string { return api.PrintableLines(strings.TrimSpace(msg)) }
