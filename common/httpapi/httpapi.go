// Package httpapi holds the HTTP conventions both agents share with dstack's:
// how JSON bodies are decoded (415/413/400 texts, unknown fields ignored), how
// errors and empty successes are written, and the echo server built on them.
// Errors become a status in exactly one place: ErrorHandler.
package httpapi

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"net"
	"net/http"
	"os"
	"strings"

	"github.com/labstack/echo/v4"

	"github.com/tandem-run/tandem/api"
)

// MaxBodyBytes is the JSON request body limit of both agents.
const MaxBodyBytes = api.MaxJSONBody

// Error is an API error: a status and the message shown to the client.
// Err, if set, is the internal cause, logged but never sent.
type Error struct {
	Status  int
	Message string
	Err     error
}

func (e *Error) Error() string {
	if e.Err != nil {
		if cause := e.Err.Error(); strings.HasPrefix(cause, e.Message) {
			// The cause already says it (a class error wrapped with its
			// detail): once in the log is enough.
			return fmt.Sprintf("%d %s", e.Status, cause)
		}
		return fmt.Sprintf("%d %s: %v", e.Status, e.Message, e.Err)
	}
	return fmt.Sprintf("%d %s", e.Status, e.Message)
}

func (e *Error) Unwrap() error { return e.Err }

// Internal is a 500 whose text is chosen here, never the cause's: an
// internal error's text carries host paths and Go wording that are the
// operator's to read (in the agent's log, with the request), not a
// client's. what says what failed, in the client's terms.
func Internal(what string, cause error) *Error {
	return &Error{Status: http.StatusInternalServerError, Message: "internal error: " + what + " (the agent's log has the cause)", Err: cause}
}

// Errorf returns an *Error with a formatted message.
func Errorf(status int, format string, args ...any) *Error {
	return &Error{Status: status, Message: fmt.Sprintf(format, args...)}
}

// DecodeJSON decodes the request body into v with dstack's rules: a present
// Content-Type must be application/json; at most 1 MiB; not empty; exactly one
// JSON value; unknown fields ignored. Failures are *Error with a 4xx status.
func DecodeJSON(r *http.Request, w http.ResponseWriter, v any) error {
	if ct := r.Header.Get("Content-Type"); ct != "" {
		mt, _, err := mime.ParseMediaType(ct)
		if err != nil || mt != "application/json" {
			return Errorf(http.StatusUnsupportedMediaType, "Content-Type header is not application/json")
		}
	}
	body := http.MaxBytesReader(w, r.Body, MaxBodyBytes)
	dec := json.NewDecoder(body)
	if err := dec.Decode(v); err != nil {
		return decodeError(err)
	}
	if err := dec.Decode(&struct{}{}); !errors.Is(err, io.EOF) {
		var maxErr *http.MaxBytesError
		if errors.As(err, &maxErr) {
			return decodeError(err)
		}
		return Errorf(http.StatusBadRequest, "Request body must only contain a single JSON object")
	}
	return nil
}

func decodeError(err error) *Error {
	var syntaxErr *json.SyntaxError
	var typeErr *json.UnmarshalTypeError
	var maxErr *http.MaxBytesError
	switch {
	case errors.As(err, &maxErr):
		return Errorf(http.StatusRequestEntityTooLarge, "Request body must not be larger than 1MB")
	case errors.Is(err, io.EOF):
		return Errorf(http.StatusBadRequest, "Request body must not be empty")
	case errors.As(err, &syntaxErr):
		return Errorf(http.StatusBadRequest, "Request body contains badly-formed JSON (at position %d)", syntaxErr.Offset)
	case errors.Is(err, io.ErrUnexpectedEOF):
		return Errorf(http.StatusBadRequest, "Request body contains badly-formed JSON")
	case errors.As(err, &typeErr):
		return Errorf(http.StatusBadRequest, "Request body contains an invalid value for the %q field (at position %d)", typeErr.Field, typeErr.Offset)
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) || errors.Is(err, net.ErrClosed) || errors.Is(err, os.ErrDeadlineExceeded) {
		// The connection, not the JSON: a body cut off by its deadline or
		// by the gate evicting a slow one. The cause is kept (the error
		// handler logs a closed connection quietly), and the client is
		// not told this host's addresses.
		return &Error{Status: http.StatusBadRequest, Message: "Request body could not be read", Err: err}
	}
	// Custom UnmarshalJSON errors and the like: still the client's fault.
	return &Error{Status: http.StatusBadRequest, Message: "Request body is invalid: " + err.Error()}
}

// Bind decodes an echo request body with DecodeJSON.
func Bind(c echo.Context, v any) error {
	return DecodeJSON(c.Request(), c.Response(), v)
}

// OK writes dstack's empty success: 200, text/plain, a single newline.
func OK(c echo.Context) error {
	return writeText(c, http.StatusOK, "")
}

// JSON writes v as a JSON object followed by a newline.
// The encoder marshals into its pooled buffer and writes that once:
// nothing is written when v does not encode (the error handler answers),
// and a big answer (a runner's 1 MiB log page) is not copied out twice more
// (Marshal's copy, then the newline's), garbage that made the runner's GC
// run under its memory limit at every page.
func JSON(c echo.Context, v any) error {
	r := c.Response()
	r.Header().Set(echo.HeaderContentType, "application/json")
	if err := json.NewEncoder(r).Encode(v); err != nil {
		if !r.Committed {
			return fmt.Errorf("encode response: %w", err)
		}
		return err
	}
	return nil
}

func writeText(c echo.Context, status int, msg string) error {
	h := c.Response().Header()
	h.Set(echo.HeaderContentType, "text/plain; charset=utf-8")
	h.Set("X-Content-Type-Options", "nosniff")
	c.Response().WriteHeader(status)
	if c.Request().Method == http.MethodHead {
		return nil
	}
	_, err := io.WriteString(c.Response(), msg+"\n")
	return err
}

// ErrorHandler renders every error the way dstack's agents do: text/plain,
// the message and a newline; route misses as Go's ServeMux words them; any
// error that is not an API error becomes a 500 with an empty message.
func ErrorHandler(log *slog.Logger) echo.HTTPErrorHandler {
	return func(err error, c echo.Context) {
		if c.Response().Committed {
			log.Debug("error after response was committed", "path", c.Path(), "err", err)
			return
		}
		status, msg := StatusFor(c, err), ""
		if status == StatusCallerLeft {
			// Nobody reads an answer: a caller that gives up (dstack's
			// server after 9 s) is not the agent's internal error.
			log.Info("the caller left before the answer", "method", c.Request().Method, "path", c.Request().URL.Path, "err", err)
			return
		}
		var apiErr *Error
		var echoErr *echo.HTTPError
		switch {
		case errors.As(err, &apiErr):
			msg = apiErr.Message
			if msg == "" {
				msg = http.StatusText(status)
			}
		case errors.As(err, &echoErr) && status == http.StatusNotFound:
			msg = "404 page not found"
		case errors.As(err, &echoErr):
			msg = http.StatusText(status)
		}
		attrs := []any{"method", c.Request().Method, "path", c.Request().URL.Path, "status", status, "err", err}
		switch {
		case status == http.StatusInternalServerError:
			log.Error("internal error", attrs...)
		case status >= 500:
			// The agent could not do it (full storage, still restoring):
			// said to the caller, not a fault inside the agent.
			log.Error("request failed", attrs...)
		case errors.Is(err, net.ErrClosed):
			// The connection was closed under the request (a full gate
			// evicted a slow body): one line per eviction would let a
			// flood write the log.
			log.Debug("API error on a closed connection", attrs...)
		case status == http.StatusNotFound:
			// Expected in normal operation: the server and tandem look up
			// tasks they just removed.
			log.Debug("API error", attrs...)
		default:
			log.Warn("API error", attrs...)
		}
		if werr := writeText(c, status, msg); werr != nil {
			log.Debug("write error response", "err", werr)
		}
	}
}

// StatusCallerLeft is the status a request whose caller went away is
// counted under (nginx's 499): it is never written, nobody reads it.
const StatusCallerLeft = 499

// StatusFor is Status for a request: a context error once the request's
// own context is done is its caller leaving (StatusCallerLeft).
func StatusFor(c echo.Context, err error) int {
	if c.Request().Context().Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) {
		return StatusCallerLeft
	}
	return Status(err)
}

// Status is the HTTP status ErrorHandler writes for err: an API error's,
// an echo error's (route misses), else 500.
func Status(err error) int {
	var apiErr *Error
	var echoErr *echo.HTTPError
	switch {
	case errors.As(err, &apiErr):
		return apiErr.Status
	case errors.As(err, &echoErr):
		return echoErr.Code
	}
	return http.StatusInternalServerError
}

// Recover turns a handler panic into a 500 instead of a dead connection or a
// crashed agent.
func Recover(log *slog.Logger) echo.MiddlewareFunc {
	return func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) (err error) {
			defer func() {
				if r := recover(); r != nil {
					log.Error("handler panic", "path", c.Request().URL.Path, "panic", r)
					err = fmt.Errorf("panic: %v", r)
				}
			}()
			return next(c)
		}
	}
}

// NewEcho returns an echo instance with the shared error rendering and panic
// recovery installed and its banner silenced.
func NewEcho(log *slog.Logger) *echo.Echo {
	e := echo.New()
	e.HideBanner = true
	e.HidePort = true
	e.HTTPErrorHandler = ErrorHandler(log)
	e.Use(Recover(log))
	e.Pre(func(next echo.HandlerFunc) echo.HandlerFunc {
		return func(c echo.Context) error {
			log.Log(c.Request().Context(), slog.LevelDebug-4, "request", "method", c.Request().Method, "path", c.Request().URL.Path)
			return next(c)
		}
	})
	return e
}
