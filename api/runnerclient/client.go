// Package runnerclient is the typed client of dstack-runner's HTTP API and its
// /logs_ws WebSocket, as the dstack server and the tandem CLI use them.
package runnerclient

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/gorilla/websocket"

	"github.com/tandem-run/tandem/api"
	"github.com/tandem-run/tandem/api/internal/transport"
)

// UploadTimeout bounds uploads, like the server's 60 s.
const UploadTimeout = 60 * time.Second

// Client talks to one runner.
type Client struct {
	t *transport.Client
	// pages holds pull answer buffers between calls.
	pages sync.Pool
	// task, when set, is the shim task whose runner the client means: each
	// call names it (api.RunnerTaskParam), and a Tandem runner serving
	// another task refuses it.
	task string
}

// ForTask makes every call name the shim task whose runner c means: a
// Tandem runner that serves another (the port's runner changed: a task
// that ended, another that started) answers 409 instead of its own
// output, states or job. dstack's runner ignores the name.
func (c *Client) ForTask(id string) { c.task = id }

// path is p with the task's name added when one is set.
func (c *Client) path(p string) string {
	if c.task == "" {
		return p
	}
	sep := "?"
	if strings.Contains(p, "?") {
		sep = "&"
	}
	return p + sep + api.RunnerTaskParam + "=" + url.QueryEscape(c.task)
}

// New returns a client for addr: "host:port", "http://host:port" or
// "unix:///path.sock".
func New(addr string) (*Client, error) {
	return NewWithDialer(addr, nil)
}

// NewWithDialer is New with connections opened by dial, e.g. through an SSH
// tunnel (addr is then as seen from the far end).
func NewWithDialer(addr string, dial transport.DialFunc) (*Client, error) {
	t, err := transport.NewWithDialer(addr, dial)
	if err != nil {
		return nil, fmt.Errorf("runner client: %w", err)
	}
	return &Client{t: t}, nil
}

// BaseURL is the http:// URL the client talks to.
func (c *Client) BaseURL() string { return c.t.BaseURL }

// Healthcheck pings the runner and returns its service name and version.
func (c *Client) Healthcheck(ctx context.Context) (api.HealthcheckResponse, error) {
	var out api.HealthcheckResponse
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: c.path("/api/healthcheck")}, &out)
	return out, err
}

// Submit hands the job to the runner (allowed until Run).
func (c *Client) Submit(ctx context.Context, body api.SubmitBody) error {
	return c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: c.path("/api/submit"), JSON: body}, nil)
}

// SubmitRun hands the job to the runner and asks it to start the job at
// once (api.SubmitExtras.Run). started is false when the runner did not
// (dstack's ignores the ask): the caller then calls Run. ok says whether
// rr was told (as Run's ok).
func (c *Client) SubmitRun(ctx context.Context, body api.SubmitBody) (rr api.RunResponse, started, ok bool, err error) {
	extras := api.SubmitExtras{}
	if body.Tandem != nil {
		extras = *body.Tandem
	}
	extras.Run = true
	body.Tandem = &extras
	resp, cancel, err := c.t.Do(ctx, transport.Request{Method: http.MethodPost, Path: c.path("/api/submit"), JSON: body})
	if err != nil {
		return rr, false, false, err
	}
	defer cancel()
	defer resp.Body.Close()
	if !transport.IsJSON(resp) {
		_, _ = io.Copy(io.Discard, resp.Body)
		return rr, false, false, nil
	}
	var out api.SubmitRunResponse
	if err := json.NewDecoder(io.LimitReader(resp.Body, 64<<10)).Decode(&out); err != nil {
		return rr, false, false, fmt.Errorf("POST /api/submit: %w", err)
	}
	told := out.WorkingDir != "" || out.Username != ""
	return out.RunResponse, out.Started, told, nil
}

// UploadArchive streams one file archive (an uncompressed tar) as the
// multipart part "archive" whose filename is the archive id.
func (c *Client) UploadArchive(ctx context.Context, id string, tar io.Reader) error {
	pr, pw := io.Pipe()
	mw := multipart.NewWriter(pw)
	go func() {
		part, err := mw.CreateFormFile("archive", id)
		if err == nil {
			_, err = io.Copy(part, tar)
		}
		if err == nil {
			err = mw.Close()
		}
		pw.CloseWithError(err)
	}()
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: c.path("/api/upload_archive"),
		Body: pr, ContentType: mw.FormDataContentType(), Timeout: UploadTimeout}, nil)
	pr.CloseWithError(errors.New("request finished"))
	return err
}

// UploadCode streams the code blob (a tar, or a git diff for remote repos).
func (c *Client) UploadCode(ctx context.Context, code io.Reader) error {
	return c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: c.path("/api/upload_code"),
		Body: code, ContentType: "application/octet-stream", Timeout: UploadTimeout}, nil)
}

// Run starts the job. ok is false when the runner answered without JSON
// (old runners, or job user / working dir resolution failed).
func (c *Client) Run(ctx context.Context) (out api.RunResponse, ok bool, err error) {
	resp, cancel, err := c.t.Do(ctx, transport.Request{Method: http.MethodPost, Path: c.path("/api/run")})
	if err != nil {
		return out, false, err
	}
	defer cancel()
	defer resp.Body.Close()
	if !transport.IsJSON(resp) {
		_, _ = io.Copy(io.Discard, resp.Body)
		return out, false, nil
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil {
		return out, false, fmt.Errorf("POST /api/run: %w", err)
	}
	return out, true, nil
}

// Pull returns every state and log event newer than timestamp.
func (c *Client) Pull(ctx context.Context, timestamp int64) (api.PullResponse, error) {
	return c.pull(ctx, "/api/pull?timestamp="+strconv.FormatInt(timestamp, 10))
}

// Peek is Pull without counting as the logs' collection (a Tandem
// runner finishes only after a real pull; dstack's ignores the flag).
func (c *Client) Peek(ctx context.Context, timestamp int64) (api.PullResponse, error) {
	return c.pull(ctx, "/api/pull?peek=1&timestamp="+strconv.FormatInt(timestamp, 10))
}

// PullStates is Pull without the logs, for a caller that reads the job's
// output from /logs_ws: the job's output is never held back for it, and
// reading the end still counts as the logs' collection. A runner that does
// not know the flag (dstack's) sends the logs too; they can be ignored.
func (c *Client) PullStates(ctx context.Context, timestamp int64) (api.PullResponse, error) {
	return c.pull(ctx, "/api/pull?logs=0&timestamp="+strconv.FormatInt(timestamp, 10))
}

// PeekStates is PullStates for an onlooker (tandem attach): reading the
// end does not count as the job's logs being collected, so a job that
// another driver (the dstack server) pulls is not ended for it. A runner
// that does not know the pair of flags peeks with the logs.
func (c *Client) PeekStates(ctx context.Context, timestamp int64) (api.PullResponse, error) {
	return c.pull(ctx, "/api/pull?peek=1&logs=0&timestamp="+strconv.FormatInt(timestamp, 10))
}

// pull reads the answer into a pooled buffer (a page is up to ~1.4 MB of
// JSON; growing a fresh one per call cost page faults and GC) and decodes
// it with api.DecodePull, which copies what it keeps.
func (c *Client) pull(ctx context.Context, path string) (api.PullResponse, error) {
	buf, _ := c.pages.Get().(*bytes.Buffer)
	if buf == nil {
		buf = new(bytes.Buffer)
	}
	defer func() {
		// A buffer grown by an unusually large answer (dstack's runner
		// sends its whole history at once) is not kept.
		if buf.Cap() <= keptPage {
			buf.Reset()
			c.pages.Put(buf)
		}
	}()
	if err := c.t.Read(ctx, transport.Request{Method: http.MethodGet, Path: c.path(path)}, buf); err != nil {
		return api.PullResponse{}, err
	}
	out, err := api.DecodePull(buf.Bytes())
	if err != nil {
		return api.PullResponse{}, fmt.Errorf("GET %s: decode answer: %w", path, err)
	}
	return out, nil
}

// keptPage is the largest pull buffer kept for the next call: a Tandem
// runner's page is at most 1 MiB of logs, ~1.4 MB as JSON.
const keptPage = 4 << 20

// Stop asks the runner to stop the job gracefully.
func (c *Client) Stop(ctx context.Context) error {
	return c.t.JSON(ctx, transport.Request{Method: http.MethodPost, Path: c.path("/api/stop")}, nil)
}

// Metrics returns the container's resource usage; ErrNotFound when the
// runner has no metrics collector.
func (c *Client) Metrics(ctx context.Context) (api.MetricsResponse, error) {
	var out api.MetricsResponse
	err := c.t.JSON(ctx, transport.Request{Method: http.MethodGet, Path: c.path("/api/metrics")}, &out)
	return out, err
}

// ErrBadStartTime is returned when the runner rejected start_time (close 1003).
var ErrBadStartTime = errors.New("runner rejected start_time")

// LogStream reads raw job output from /logs_ws.
type LogStream struct {
	conn *websocket.Conn
	stop func() bool
	cur  io.Reader // the message being read
	buf  []byte
	// wantEnd: the stream was opened asking for the job's end state
	// (api.LogsEndParam); end is it, once the runner sent it.
	wantEnd bool
	end     *api.JobStateEvent
}

// Logs opens /logs_ws. With a non-zero since, history before that second is
// skipped. The stream ends with io.EOF when the runner has sent everything.
func (c *Client) Logs(ctx context.Context, since time.Time) (*LogStream, error) {
	return c.logs(ctx, since, logsFollow)
}

// LogsSoFar is Logs that ends where the job's output written so far ends
// (api.LogsSoFarParam). Only a Tandem runner knows it: dstack's follows.
func (c *Client) LogsSoFar(ctx context.Context, since time.Time) (*LogStream, error) {
	return c.logs(ctx, since, logsSoFar)
}

// logsMode is what a /logs_ws stream asks for beyond dstack's follow.
type logsMode int

const (
	logsFollow  logsMode = iota
	logsWithEnd          // the final state at the end (api.LogsEndParam)
	logsSoFar            // the output so far, no follow (api.LogsSoFarParam)
)

// LogsWithEnd is Logs that also asks for the job's final state at the
// stream's end (a Tandem runner sends it before its close; End has it),
// so a follower needs no pull to learn how the job ended.
func (c *Client) LogsWithEnd(ctx context.Context, since time.Time) (*LogStream, error) {
	return c.logs(ctx, since, logsWithEnd)
}

func (c *Client) logs(ctx context.Context, since time.Time, mode logsMode) (*LogStream, error) {
	q := url.Values{}
	if !since.IsZero() {
		q.Set("start_time", since.Format(time.RFC3339Nano))
	}
	switch mode {
	case logsWithEnd:
		q.Set(api.LogsEndParam, "1")
	case logsSoFar:
		q.Set(api.LogsSoFarParam, "1")
	}
	conn, err := c.dialWS(ctx, "logs", "/logs_ws", q)
	if err != nil {
		return nil, err
	}
	// Close the socket when ctx ends so a blocked Next returns.
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	return &LogStream{conn: conn, stop: stop, wantEnd: mode == logsWithEnd}, nil
}

// logChunk bounds what one Next returns: a message of any size (the
// runner's, or whatever answers on its port) is read in pieces, never
// held whole.
const logChunk = 64 << 10

// maxEndMessage bounds the end state's message.
const maxEndMessage = 64 << 10

// Next returns the next chunk of raw output (ANSI and \r\n included), at
// most 64 KiB; the slice is valid until the next call.
func (s *LogStream) Next() ([]byte, error) {
	if s.buf == nil {
		s.buf = make([]byte, logChunk)
	}
	for {
		if s.cur != nil {
			n, err := s.cur.Read(s.buf)
			if n > 0 {
				return s.buf[:n], nil
			}
			switch {
			case errors.Is(err, io.EOF):
				s.cur = nil
			case err != nil:
				return nil, streamErr(err)
			}
			continue
		}
		typ, r, err := s.conn.NextReader()
		if err != nil {
			return nil, streamErr(err)
		}
		switch typ {
		case websocket.TextMessage:
			if s.wantEnd {
				end, read, ok := readEnd(r)
				if ok {
					s.end = &end
					continue
				}
				// Not an end state: output, as another runner may send.
				r = io.MultiReader(bytes.NewReader(read), r)
			}
			s.cur = r
		case websocket.BinaryMessage:
			s.cur = r
		}
	}
}

// readEnd reads a text message as the job's end state (api.LogsEnd with a
// final state); when it is none, read is what was taken from r.
func readEnd(r io.Reader) (end api.JobStateEvent, read []byte, ok bool) {
	read, err := io.ReadAll(io.LimitReader(r, maxEndMessage+1))
	if err != nil || len(read) > maxEndMessage {
		return end, read, false
	}
	var m api.LogsEnd
	if json.Unmarshal(read, &m) != nil || m.End == nil || !m.End.State.Final() {
		return end, read, false
	}
	return *m.End, nil, true
}

// End is the job's final state the runner sent at the stream's end (a
// stream opened with LogsWithEnd, from a Tandem runner).
func (s *LogStream) End() (api.JobStateEvent, bool) {
	if s.end == nil {
		return api.JobStateEvent{}, false
	}
	return *s.end, true
}

// streamErr is a read error of the stream in the caller's terms.
func streamErr(err error) error {
	var ce *websocket.CloseError
	if errors.As(err, &ce) {
		switch ce.Code {
		case websocket.CloseNoStatusReceived, websocket.CloseNormalClosure:
			return io.EOF
		case websocket.CloseUnsupportedData:
			return fmt.Errorf("%w: %s", ErrBadStartTime, ce.Text)
		}
	}
	return fmt.Errorf("logs: %w", err)
}

// Close ends the stream.
func (s *LogStream) Close() error {
	s.stop()
	return s.conn.Close()
}

// stdinChunk is the most one stdin message carries.
const stdinChunk = 32 << 10

// FeedStdin sends r to the job's standard input and each size of
// resizes to its terminal, on the job's stream (api.StdinPath; the job
// was submitted with api.StdinStream or a TTY size), until r ends, then
// closes the stream: the job reads end of file. r nil sends no input (a
// TTY job's stream for its resizes): the stream lasts until ctx ends or
// the runner closes it. It returns nil when r ended and when the job no
// longer reads (the runner closed the stream normally: the job ended), an
// error with the runner's reason when it closed the stream otherwise, and
// the dial's or r's error. ctx ending closes the stream. Only a Tandem
// runner has the route: dstack's answers 404.
func (c *Client) FeedStdin(ctx context.Context, r io.Reader, resizes <-chan api.TermSize) error {
	conn, err := c.dialWS(ctx, "stdin", api.StdinPath, url.Values{})
	if err != nil {
		return err
	}
	defer conn.Close()
	stop := context.AfterFunc(ctx, func() { conn.Close() })
	defer stop()
	// The runner sends nothing but its close: read for it (and for
	// control frames) so a write blocked on a job that stopped reading,
	// or a wait for the echo of our close, ends with the stream.
	ended := make(chan error, 1) // how the stream ended, read once
	go func() {
		for {
			if _, _, err := conn.NextReader(); err != nil {
				ended <- err
				return
			}
		}
	}()
	awaitEnd := func() error {
		select {
		case err := <-ended:
			return err
		case <-time.After(5 * time.Second):
		case <-ctx.Done():
		}
		return nil
	}
	quit := make(chan struct{})
	defer close(quit)
	var chunks <-chan stdinRead
	if r != nil {
		chunks = readChunks(r, quit)
	}
	writeFailed := func(err error) error {
		// The runner's close may be on its way behind the failure.
		end := awaitEnd()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if cerr := runnerClosed(end); cerr != nil || isClose(end) {
			return cerr
		}
		return fmt.Errorf("stdin: %w", err)
	}
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case end := <-ended:
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if !isClose(end) {
				return fmt.Errorf("stdin: %w", end)
			}
			return runnerClosed(end)
		case s, ok := <-resizes:
			if !ok {
				resizes = nil
				continue
			}
			msg, err := json.Marshal(api.StdinControl{Resize: &s})
			if err != nil {
				return fmt.Errorf("stdin: resize: %w", err)
			}
			if err := conn.WriteMessage(websocket.TextMessage, msg); err != nil {
				return writeFailed(err)
			}
		case in := <-chunks:
			if len(in.b) > 0 {
				if err := conn.WriteMessage(websocket.BinaryMessage, in.b); err != nil {
					return writeFailed(err)
				}
			}
			if in.err != nil {
				// The end of the input (or a read error: the job gets its
				// end all the same, as an SSH session's command does).
				_ = conn.WriteControl(websocket.CloseMessage, websocket.FormatCloseMessage(websocket.CloseNormalClosure, ""), time.Now().Add(5*time.Second))
				_ = awaitEnd()
				if errors.Is(in.err, io.EOF) {
					return nil
				}
				return fmt.Errorf("stdin: reading the input: %w", in.err)
			}
		}
	}
}

// stdinRead is one read of a job's input: its bytes, then its error.
type stdinRead struct {
	b   []byte
	err error
}

// readChunks reads r into the returned channel until r fails (io.EOF
// included) or quit is closed. Two buffers take turns: one is read into
// only once the other was taken, after its receiver is done with the one
// before (the channel is unbuffered).
func readChunks(r io.Reader, quit <-chan struct{}) <-chan stdinRead {
	out := make(chan stdinRead)
	go func() {
		bufs := [2][]byte{make([]byte, stdinChunk), make([]byte, stdinChunk)}
		for i := 0; ; i ^= 1 {
			n, err := r.Read(bufs[i])
			select {
			case out <- stdinRead{bufs[i][:n], err}:
			case <-quit:
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return out
}

// isClose says whether err is the runner's close of the stream.
func isClose(err error) bool {
	var ce *websocket.CloseError
	return errors.As(err, &ce)
}

// runnerClosed is the runner's close of a job's stream as FeedStdin
// returns it: nil for a normal close (the job no longer reads), else an
// error with the runner's reason (a control or input it refused).
func runnerClosed(err error) error {
	var ce *websocket.CloseError
	if !errors.As(err, &ce) || ce.Code == websocket.CloseNormalClosure || ce.Code == websocket.CloseNoStatusReceived {
		return nil
	}
	return fmt.Errorf("stdin: the runner closed the stream (%d): %s", ce.Code, api.Printable(ce.Text))
}

// dialWS opens the runner's WebSocket at path with query q (plus the task
// this client means); what names the call in errors. An HTTP answer
// instead of the upgrade is an api.StatusError.
func (c *Client) dialWS(ctx context.Context, what, path string, q url.Values) (*websocket.Conn, error) {
	u, err := url.Parse(c.t.BaseURL)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", what, err)
	}
	u.Scheme = "ws"
	u.Path = path
	if c.task != "" {
		q.Set(api.RunnerTaskParam, c.task)
	}
	u.RawQuery = q.Encode()
	// A read buffer that takes a whole output message (the runner's are at
	// most 64 KiB) in one read, not 4 KiB at a time.
	d := websocket.Dialer{NetDialContext: c.t.Dial, HandshakeTimeout: transport.DefaultTimeout, ReadBufferSize: logChunk + 16}
	conn, resp, err := d.DialContext(ctx, u.String(), nil)
	if err != nil {
		if resp != nil {
			return nil, &api.StatusError{Method: http.MethodGet, Path: path, Code: resp.StatusCode}
		}
		return nil, fmt.Errorf("%s: dial %s: %w", what, u.Redacted(), err)
	}
	return conn, nil
}
