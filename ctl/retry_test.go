package ctl

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"syscall"
	"testing"
	"time"

	"github.com/tandem-run/tandem/api"
)

func TestTransient(t *testing.T) {
	for err, want := range map[error]bool{
		context.DeadlineExceeded:                               true,
		fmt.Errorf("dial: %w", syscall.ECONNREFUSED):           true,
		io.ErrUnexpectedEOF:                                    true,
		&api.StatusError{Code: http.StatusServiceUnavailable}:  true,
		&api.StatusError{Code: http.StatusInternalServerError}: true,
		&api.StatusError{Code: http.StatusNotFound}:            false,
		&api.StatusError{Code: http.StatusInsufficientStorage}: false, // a full home: only its operator frees it
		&api.StatusError{Code: http.StatusNotImplemented}:      false,
		&api.StatusError{Code: http.StatusConflict}:            false,
		errors.New("decode answer: invalid character"):         false,
	} {
		if Transient(err) != want {
			t.Errorf("Transient(%v) = %v", err, !want)
		}
	}
}

func TestRetry(t *testing.T) {
	n := 0
	v, err := retry(context.Background(), nil, time.Minute, func(context.Context) (int, error) {
		if n++; n < 3 {
			return 0, &api.StatusError{Code: http.StatusServiceUnavailable}
		}
		return 7, nil
	})
	if err != nil || v != 7 || n != 3 {
		t.Fatalf("transient then ok: %d %v after %d", v, err, n)
	}
	n = 0
	_, err = retry(context.Background(), nil, time.Minute, func(context.Context) (int, error) {
		n++
		return 0, &api.StatusError{Code: http.StatusNotFound}
	})
	if !errors.Is(err, api.ErrNotFound) || n != 1 {
		t.Fatalf("final error retried: %v after %d", err, n)
	}
	n = 0
	_, err = retry(context.Background(), nil, 600*time.Millisecond, func(context.Context) (int, error) {
		n++
		return 0, syscall.ECONNREFUSED
	})
	if err == nil || n < 2 || n > 4 {
		t.Fatalf("patience: %v after %d", err, n)
	}
}
