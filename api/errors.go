package api

import (
	"errors"
	"fmt"
	"net/http"
)

// Error classes of agent answers, for errors.Is on a *StatusError.
var (
	ErrNotFound   = errors.New("not found")
	ErrConflict   = errors.New("conflict")
	ErrBadRequest = errors.New("bad request")
)

// StatusError is a non-2xx answer from an agent: its status and the message
// from its text/plain body.
type StatusError struct {
	Method, Path string
	Code         int
	Message      string
}

func (e *StatusError) Error() string {
	msg := e.Message
	if msg == "" {
		msg = http.StatusText(e.Code)
	}
	return fmt.Sprintf("%s %s: %d: %s", e.Method, e.Path, e.Code, Printable(msg))
}

// Is maps the status to the error classes above.
func (e *StatusError) Is(target error) bool {
	switch target {
	case ErrNotFound:
		return e.Code == http.StatusNotFound
	case ErrConflict:
		return e.Code == http.StatusConflict
	case ErrBadRequest:
		return e.Code == http.StatusBadRequest
	}
	return false
}
