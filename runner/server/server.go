// Package server is dstack-runner's HTTP API and /logs_ws WebSocket on echo.
package server

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"mime"
	"mime/multipart"
	"net/http"
	"strconv"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/gorilla/websocket"
	"github.com/labstack/echo/v4"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/common/httpapi"
	"github.com/tandem-run/tandem/runner/executor"
	"github.com/tandem-run/tandem/runner/logs"
	"github.com/tandem-run/tandem/runner/metrics"
)

// Metrics is what /api/metrics needs.
type Metrics interface {
	Collect(ctx context.Context) (api.MetricsResponse, error)
}

// Deps are the server's collaborators.
type Deps struct {
	Version       string
	TandemVersion string // Tandem's own release, beside the dstack version
	TaskID        string // the shim task served ("" when not told)
	Executor      *executor.Executor
	Metrics       Metrics
	Log           *slog.Logger
	// PingInterval for WebSocket clients (default 30 s).
	PingInterval time.Duration
}

type srv struct {
	d Deps
	// pages holds /api/pull answer buffers between pulls (a page is up
	// to ~1.4 MB of JSON).
	pages sync.Pool
}

// New returns the echo instance serving the runner API.
func New(d Deps) *echo.Echo {
	if d.PingInterval == 0 {
		d.PingInterval = 30 * time.Second
	}
	e := httpapi.NewEcho(d.Log)
	s := &srv{d: d}
	e.Use(s.sameTask)
	e.GET("/api/healthcheck", s.healthcheck)
	e.HEAD("/api/healthcheck", s.healthcheck)
	e.GET("/api/metrics", s.metrics)
	e.POST("/api/submit", s.submit)
	e.POST("/api/upload_archive", s.uploadArchive)
	e.POST("/api/upload_code", s.uploadCode)
	e.POST("/api/run", s.run)
	e.GET("/api/pull", s.pull)
	e.POST("/api/stop", s.stop)
	e.GET("/logs_ws", s.logsWS)
	e.GET(api.StdinPath, s.stdinWS)
	return e
}

// sameTask refuses (409, before anything is read or done) a call that
// names a shim task other than the one this runner serves
// (api.RunnerTaskParam): its client means the runner that held this port
// before, or will. A call that names none, or a runner told none, passes.
func (s *srv) sameTask(next echo.HandlerFunc) echo.HandlerFunc {
	return func(c echo.Context) error {
		if want := c.QueryParam(api.RunnerTaskParam); want != "" && s.d.TaskID != "" && want != s.d.TaskID {
			return httpapi.Errorf(http.StatusConflict, "this runner serves task %s, not %s", s.d.TaskID, api.Printable(want))
		}
		return next(c)
	}
}

func toHTTP(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, executor.ErrState):
		return &httpapi.Error{Status: http.StatusConflict, Message: http.StatusText(http.StatusConflict), Err: err}
	case errors.Is(err, executor.ErrBadInput):
		return &httpapi.Error{Status: http.StatusBadRequest, Message: err.Error()}
	case errors.Is(err, executor.ErrTooLarge):
		return &httpapi.Error{Status: http.StatusRequestEntityTooLarge, Message: err.Error()}
	}
	return httpapi.Internal("the request failed", err)
}

func (s *srv) healthcheck(c echo.Context) error {
	return httpapi.JSON(c, api.HealthcheckResponse{Service: api.ServiceRunner, Version: s.d.Version, TandemVersion: s.d.TandemVersion, TaskID: s.d.TaskID})
}

func (s *srv) metrics(c echo.Context) error {
	if s.d.Metrics == nil {
		return httpapi.Errorf(http.StatusNotFound, "Metrics collector is not available")
	}
	m, err := s.d.Metrics.Collect(c.Request().Context())
	if errors.Is(err, metrics.ErrUnavailable) {
		return httpapi.Errorf(http.StatusNotFound, "Metrics collector is not available")
	}
	if err != nil {
		return httpapi.Internal("collecting the job's metrics failed", err)
	}
	return httpapi.JSON(c, m)
}

func (s *srv) submit(c echo.Context) error {
	var body api.SubmitBody
	if err := httpapi.Bind(c, &body); err != nil {
		return err
	}
	if err := s.d.Executor.Submit(body); err != nil {
		return toHTTP(err)
	}
	if body.Tandem == nil || !body.Tandem.Run {
		return httpapi.OK(c)
	}
	// A Tandem client with no code to upload: the job starts now, as a
	// /api/run right after would start it.
	rr, _, err := s.d.Executor.Run()
	if err != nil {
		return toHTTP(err)
	}
	return httpapi.JSON(c, api.SubmitRunResponse{Started: true, RunResponse: rr})
}

func (s *srv) uploadArchive(c echo.Context) error {
	if s.d.Executor.State() != executor.WaitRun {
		return toHTTP(executor.ErrState)
	}
	ct := c.Request().Header.Get("Content-Type")
	if ct == "" {
		return httpapi.Errorf(http.StatusBadRequest, "missing content-type header")
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err != nil {
		return httpapi.Errorf(http.StatusBadRequest, "malformed content-type header: %v", err)
	}
	if mt != "multipart/form-data" {
		return httpapi.Errorf(http.StatusBadRequest, "multipart/form-data expected, got %s", mt)
	}
	if params["boundary"] == "" {
		return httpapi.Errorf(http.StatusBadRequest, "missing boundary")
	}
	mr := multipart.NewReader(c.Request().Body, params["boundary"])
	part, err := mr.NextPart()
	if errors.Is(err, io.EOF) {
		return httpapi.Errorf(http.StatusBadRequest, "empty form")
	}
	if err != nil {
		return httpapi.Errorf(http.StatusBadRequest, "malformed form: %v", err)
	}
	// The raw filename: Part.FileName() strips directories, which would hide
	// an id like "../x" instead of rejecting it.
	_, disp, _ := mime.ParseMediaType(part.Header.Get("Content-Disposition"))
	switch {
	case part.FormName() == "":
		return httpapi.Errorf(http.StatusBadRequest, "missing field name")
	case part.FormName() != "archive":
		return httpapi.Errorf(http.StatusBadRequest, "unexpected field %s", part.FormName())
	case disp["filename"] == "":
		return httpapi.Errorf(http.StatusBadRequest, "missing file name")
	}
	if err := s.d.Executor.UploadArchive(disp["filename"], part); err != nil {
		return toHTTP(err)
	}
	if _, err := mr.NextPart(); !errors.Is(err, io.EOF) {
		return httpapi.Errorf(http.StatusBadRequest, "extra form field(s)")
	}
	return httpapi.OK(c)
}

func (s *srv) uploadCode(c echo.Context) error {
	if err := s.d.Executor.UploadCode(c.Request().Body); err != nil {
		return toHTTP(err)
	}
	return httpapi.OK(c)
}

func (s *srv) run(c echo.Context) error {
	resp, ok, err := s.d.Executor.Run()
	if err != nil {
		return toHTTP(err)
	}
	if !ok {
		return httpapi.OK(c)
	}
	return httpapi.JSON(c, resp)
}

func (s *srv) pull(c echo.Context) error {
	ts := int64(0)
	if q := c.QueryParam("timestamp"); q != "" {
		v, err := strconv.ParseInt(q, 10, 64)
		if err != nil {
			return httpapi.Errorf(http.StatusBadRequest, "timestamp must be an integer")
		}
		ts = v
	}
	// Tandem's own flags; dstack's server never sends them.
	pull := s.d.Executor.Pull
	peek, states := c.QueryParam("peek") == "1", c.QueryParam("logs") == "0"
	switch {
	case peek && states: // an onlooker that reads /logs_ws (tandem attach)
		pull = s.d.Executor.PeekStates
	case peek: // onlookers
		pull = s.d.Executor.Peek
	case states: // a driver that reads /logs_ws
		pull = s.d.Executor.PullStates
	}
	resp, err := pull(ts)
	if err != nil {
		return toHTTP(err)
	}
	// Encoded by hand into a kept buffer (json.Encoder's bytes, see
	// api.AppendPull) and sent with its length.
	buf, _ := s.pages.Get().(*[]byte)
	if buf == nil {
		buf = new([]byte)
	}
	if need := api.PullSize(resp); cap(*buf) < need {
		*buf = make([]byte, 0, need)
	}
	out, err := api.AppendPull((*buf)[:0], resp)
	if err != nil {
		return httpapi.Internal("encode the answer", err)
	}
	h := c.Response().Header()
	h.Set(echo.HeaderContentType, "application/json")
	h.Set(echo.HeaderContentLength, strconv.Itoa(len(out)))
	c.Response().WriteHeader(http.StatusOK)
	_, werr := c.Response().Write(out)
	if cap(out) <= keptPage {
		*buf = out[:0]
		s.pages.Put(buf)
	}
	return werr
}

// keptPage is the largest pull buffer kept for the next pull: a page
// carries at most PullCap (1 MiB) of logs, ~1.4 MB as JSON.
const keptPage = 4 << 20

func (s *srv) stop(c echo.Context) error {
	s.d.Executor.Stop()
	return httpapi.OK(c)
}

// wsChunk is the most output one /logs_ws message carries.
const wsChunk = 64 << 10

// upgrader's write buffer holds a whole message and its frame header: a
// message goes out as one frame in one write. With the default 4 KiB
// buffer a 32 KiB message was eight frames and eight writes, and the
// client read it 4 KiB at a time (issue 67, item 7).
var upgrader = websocket.Upgrader{CheckOrigin: func(*http.Request) bool { return true },
	ReadBufferSize: 1 << 10, WriteBufferSize: wsChunk + 16, WriteBufferPool: &sync.Pool{}}

func (s *srv) logsWS(c echo.Context) error {
	conn, err := upgrader.Upgrade(c.Response(), c.Request(), nil)
	if err != nil {
		return nil // the upgrader already answered
	}
	defer conn.Close()
	var since time.Time
	if q := c.QueryParam("start_time"); q != "" {
		since, err = time.Parse(time.RFC3339Nano, q)
		if err != nil {
			_ = conn.WriteControl(websocket.CloseMessage,
				websocket.FormatCloseMessage(websocket.CloseUnsupportedData, "failed to parse start_time value"), time.Now().Add(time.Second))
			return nil
		}
	}
	wantEnd := c.QueryParam(api.LogsEndParam) == "1"
	soFar := c.QueryParam(api.LogsSoFarParam) == "1"
	defer s.d.Executor.Streamers().Join()()
	ctx, cancel := context.WithCancel(c.Request().Context())
	defer cancel()
	// Read (and discard) so pongs and the client's close are processed.
	go func() {
		defer cancel()
		for {
			if _, _, err := conn.NextReader(); err != nil {
				return
			}
		}
	}()
	var hist *logs.History
	if soFar { // what there is now: none before the job starts
		hist = s.d.Executor.HistoryIfStarted()
	} else {
		hist, err = s.d.Executor.History(ctx)
	}
	if err != nil || hist == nil {
		_ = conn.WriteControl(websocket.CloseMessage, []byte{}, time.Now().Add(time.Second))
		return nil
	}
	var r *logs.HistoryReader
	if soFar {
		r = hist.ReaderSoFar(since)
	} else {
		r = hist.Reader(since)
	}
	ping := time.NewTicker(s.d.PingInterval)
	defer ping.Stop()
	chunks := make(chan []byte)
	errc := make(chan error, 1)
	go func() {
		for {
			b, err := r.Next(ctx, wsChunk)
			if err != nil {
				errc <- err
				return
			}
			select {
			case chunks <- b:
			case <-ctx.Done():
				errc <- ctx.Err()
				return
			}
		}
	}()
	for {
		select {
		case b := <-chunks:
			_ = conn.SetWriteDeadline(time.Now().Add(30 * time.Second))
			if err := conn.WriteMessage(websocket.BinaryMessage, b); err != nil {
				return nil
			}
		case <-ping.C:
			if err := conn.WriteControl(websocket.PingMessage, nil, time.Now().Add(5*time.Second)); err != nil {
				return nil
			}
		case err := <-errc:
			if errors.Is(err, io.EOF) {
				// Everything delivered. A Tandem client that asked gets the
				// job's final state (recorded before the history closed),
				// then the close, like dstack's runner's (empty payload).
				if wantEnd {
					if ev, ok := s.d.Executor.FinalState(); ok {
						if b, err := json.Marshal(api.LogsEnd{End: &ev}); err == nil {
							_ = conn.SetWriteDeadline(time.Now().Add(5 * time.Second))
							_ = conn.WriteMessage(websocket.TextMessage, b)
						}
					}
				}
				_ = conn.WriteControl(websocket.CloseMessage, []byte{}, time.Now().Add(time.Second))
			}
			return nil
		}
	}
}

// stdinWS is the job's stream from one client (api.StdinPath): its binary
// messages, in order, are the job's stdin until its close, which the job
// reads as end of file (so does a client that goes away); its text
// messages are controls (api.StdinControl: a resize). Once the job no
// longer reads (it ended, or never started), at a control it cannot read
// and at input for a job that takes none, the stream ends with the
// reason; what the client still sends until it answers the close is read
// and dropped, so its writes end with that close, not a reset connection.
func (s *srv) stdinWS(c echo.Context) error {
	w, release, err := s.d.Executor.TakeStdin()
	if err != nil {
		return toHTTP(err)
	}
	conn, err := upgrader.Upgrade(c.Response(), c.Request(), nil)
	if err != nil {
		// Not a WebSocket (the upgrader answered): the input is still
		// the next client's.
		release()
		return nil
	}
	if w != nil {
		defer w.Close()
	}
	defer conn.Close()
	var closeOnce sync.Once
	over := func(code int, reason string) {
		closeOnce.Do(func() {
			_ = conn.WriteControl(websocket.CloseMessage,
				websocket.FormatCloseMessage(code, reason), time.Now().Add(time.Second))
			_ = conn.SetReadDeadline(time.Now().Add(stdinCloseWait))
		})
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-s.d.Executor.Finished():
			over(websocket.CloseNormalClosure, "the job ended") // a client with nothing to send waits in NextReader
		case <-done:
		}
	}()
	feeding := true // until the stream is over: then everything is dropped
	for {
		typ, r, err := conn.NextReader()
		if err != nil {
			return nil // the client's close, its going, or the wait after ours: the input ends
		}
		switch {
		case !feeding:
		case typ == websocket.TextMessage:
			if code, reason := s.stdinControl(r); code != 0 {
				feeding = false
				over(code, reason)
			}
		case typ != websocket.BinaryMessage:
		case w == nil:
			feeding = false
			s.d.Log.Warn("stdin stream: input for a job that reads none; closing it")
			over(websocket.CloseUnsupportedData, "the job reads no input (it was submitted without tandem.stdin "+api.StdinStream+")")
		default:
			if _, err := io.Copy(w, r); err != nil {
				feeding = false
				if !errors.Is(err, executor.ErrStdinOver) {
					return nil
				}
				over(websocket.CloseNormalClosure, "the job no longer reads its stdin")
			}
		}
		_, _ = io.Copy(io.Discard, r)
	}
}

// stdinControl reads and applies one control message of a job's stream;
// a message it cannot read is logged and answered with the close code
// and reason that end the stream (0 when none: it was applied, or the job
// is past resizing).
func (s *srv) stdinControl(r io.Reader) (code int, reason string) {
	b, err := io.ReadAll(io.LimitReader(r, api.MaxStdinControl+1))
	if err != nil {
		return 0, "" // the connection's failure: the next read ends the stream
	}
	if len(b) > api.MaxStdinControl {
		s.d.Log.Warn("stdin stream: control message too large; closing it", "max_bytes", api.MaxStdinControl)
		return websocket.CloseMessageTooBig, fmt.Sprintf("a control message holds at most %d bytes", api.MaxStdinControl)
	}
	ctl, err := api.ParseStdinControl(b)
	if err != nil {
		s.d.Log.Warn("stdin stream: bad control message; closing it", "err", err)
		return websocket.CloseInvalidFramePayloadData, closeReason(api.Printable(err.Error()))
	}
	if err := s.d.Executor.Resize(*ctl.Resize); err != nil && !errors.Is(err, executor.ErrState) {
		s.d.Log.Warn("stdin stream: resize", "err", err)
	}
	return 0, ""
}

// closeReason is s cut to what a close frame carries (123 bytes), at a
// character's start.
func closeReason(s string) string {
	const most = 123
	if len(s) <= most {
		return s
	}
	cut := most
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut]
}

// stdinCloseWait bounds how long a stdin stream the runner closed waits
// for the client's answer.
const stdinCloseWait = 2 * time.Second
