package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"syscall"
	"time"

	"github.com/tandem-run/tandem/api"
)

// Transient says whether a failed call to an agent may succeed if made
// again: a call that timed out, a connection refused, reset or cut short,
// an answer of 5xx (503 while a restarted shim restores its tasks) or 429.
// A 4xx answer, a decode failure or a refused host key is final, as are
// 507 (the shim's home is full: nothing frees it but its operator, so the
// user reads that now, not after minutes of silent retries) and 501.
func Transient(err error) bool {
	if err == nil {
		return false
	}
	var se *api.StatusError
	if errors.As(err, &se) {
		switch se.Code {
		case http.StatusInsufficientStorage, http.StatusNotImplemented:
			return false
		}
		return se.Code >= 500 || se.Code == http.StatusTooManyRequests
	}
	var ne net.Error
	switch {
	case errors.Is(err, context.DeadlineExceeded), errors.As(err, &ne) && ne.Timeout():
		return true
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return true
	}
	return false
}

// Backoff of retried calls.
const (
	retryFirst = 250 * time.Millisecond
	retryMax   = 5 * time.Second
)

// retry makes call until it succeeds, fails for good (not Transient), ctx
// ends, or for longer than patience no attempt succeeded; transient
// failures are retried with backoff. Each attempt keeps its own timeout
// (the client's), so one slow answer is only one failed attempt. The error
// returned is the last attempt's, saying how long it was tried.
func retry[T any](ctx context.Context, clk Clock, patience time.Duration, call func(context.Context) (T, error)) (T, error) {
	clk = clockOr(clk)
	start := clk.Now()
	backoff := retryFirst
	for attempt := 1; ; attempt++ {
		v, err := call(ctx)
		if err == nil || !Transient(err) || ctx.Err() != nil {
			return v, err
		}
		if took := clk.Now().Sub(start); took+backoff > patience {
			return v, fmt.Errorf("%w (tried %d times over %s)", err, attempt, took.Round(time.Second))
		}
		select {
		case <-ctx.Done():
			return v, err
		case <-clk.After(backoff):
		}
		backoff = min(2*backoff, retryMax)
	}
}

// Patience of the client's waits: how long an agent may not answer before
// a run gives up on it (a loaded host answers late, a restarted shim
// answers 503 while it restores its tasks).
const (
	waitPatience    = 2 * time.Minute
	cleanupPatience = time.Minute
)
