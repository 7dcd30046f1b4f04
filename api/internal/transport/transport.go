// Package transport is the HTTP plumbing shared by the typed agent clients:
// addressing over TCP or a Unix socket, per-call timeouts, JSON bodies and
// turning non-2xx answers into *api.StatusError.
package transport

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/tandem-run/tandem/api"
)

// DefaultTimeout bounds each call, like the dstack server's 9 s.
const DefaultTimeout = 9 * time.Second

// maxErrorBody caps how much of an error body is read into a message.
const maxErrorBody = 64 << 10

// MaxAnswer bounds a JSON answer: the largest legitimate one (a task list
// of a busy shim, a 1 MiB pull) is far below; a hostile or broken agent
// cannot make a client hold more.
const MaxAnswer = 16 << 20

// Client talks HTTP to one agent.
type Client struct {
	// BaseURL is "http://host:port" (for Unix sockets the host is a placeholder).
	BaseURL string
	// HTTP carries the requests; its Transport dials the socket when needed.
	HTTP *http.Client
	// Timeout bounds calls whose context has no deadline; 0 means DefaultTimeout.
	Timeout time.Duration
	// Dial is the dialer used for the address (needed by WebSocket clients).
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// Token, when set, is sent as "Authorization: Bearer <token>".
	Token string
}

// DialFunc opens a connection to an agent.
type DialFunc func(ctx context.Context, network, addr string) (net.Conn, error)

// New parses addr: "host:port", "http://host:port" or "unix:///path.sock".
func New(addr string) (*Client, error) {
	return NewWithDialer(addr, nil)
}

// NewWithDialer is New with connections opened by dial (for instance through
// an SSH tunnel, where addr is as seen from the far end). nil: a plain dialer.
func NewWithDialer(addr string, through DialFunc) (*Client, error) {
	var d net.Dialer
	dial := d.DialContext
	if through != nil {
		dial = through
	}
	base := addr
	switch {
	case strings.HasPrefix(addr, "unix://"):
		sock := strings.TrimPrefix(addr, "unix://")
		if sock == "" {
			return nil, fmt.Errorf("address %q: empty socket path", addr)
		}
		inner := dial
		dial = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return inner(ctx, "unix", sock)
		}
		base = "http://agent.sock"
	case strings.HasPrefix(addr, "http://"):
	case strings.Contains(addr, "://"):
		return nil, fmt.Errorf("address %q: only http:// and unix:// are supported", addr)
	default:
		if _, _, err := net.SplitHostPort(addr); err != nil {
			return nil, fmt.Errorf("address %q: %w", addr, err)
		}
		base = "http://" + addr
	}
	// streams carries what lean does not (uploads), kept alive as lean's
	// pool is (see lean.maxIdle).
	streams := &http.Transport{
		DialContext:         dial,
		MaxIdleConnsPerHost: 64,
		IdleConnTimeout:     90 * time.Second,
		// Agents are reached over loopback or SSH tunnels; never via a proxy.
		Proxy: nil,
	}
	return &Client{BaseURL: strings.TrimRight(base, "/"), HTTP: &http.Client{Transport: newLean(dial, streams)}, Dial: dial}, nil
}

// Request describes one call.
type Request struct {
	Method, Path string
	// JSON, if non-nil, is encoded as the body with Content-Type application/json.
	JSON any
	// Body and ContentType are used when JSON is nil.
	Body        io.Reader
	ContentType string
	// Timeout overrides the client's for this call; negative means none.
	Timeout time.Duration
	// Header is added to the request's headers.
	Header http.Header
}

// Do performs the call. On a 2xx answer the response is returned open; the
// caller closes its body. Other answers become *api.StatusError.
func (c *Client) Do(ctx context.Context, r Request) (*http.Response, context.CancelFunc, error) {
	cancel := context.CancelFunc(func() {})
	timeout := r.Timeout
	if timeout == 0 {
		timeout = c.Timeout
	}
	if timeout == 0 {
		timeout = DefaultTimeout
	}
	if _, has := ctx.Deadline(); !has && timeout > 0 {
		ctx, cancel = context.WithTimeout(ctx, timeout)
	}
	body, ctype := r.Body, r.ContentType
	if r.JSON != nil {
		b, err := json.Marshal(r.JSON)
		if err != nil {
			cancel()
			return nil, nil, fmt.Errorf("encode %s %s: %w", r.Method, r.Path, err)
		}
		body, ctype = bytes.NewReader(b), "application/json"
	}
	req, err := http.NewRequestWithContext(ctx, r.Method, c.BaseURL+r.Path, body)
	if err != nil {
		cancel()
		return nil, nil, fmt.Errorf("build %s %s: %w", r.Method, r.Path, err)
	}
	for k, v := range r.Header {
		req.Header[k] = v
	}
	if ctype != "" {
		req.Header.Set("Content-Type", ctype)
	}
	if c.Token != "" {
		req.Header.Set("Authorization", "Bearer "+c.Token)
	}
	resp, err := c.HTTP.Do(req)
	if err != nil {
		cancel()
		return nil, nil, fmt.Errorf("%s %s: %w", r.Method, r.Path, err)
	}
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		defer cancel()
		defer resp.Body.Close()
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		return nil, nil, &api.StatusError{Method: r.Method, Path: r.Path, Code: resp.StatusCode, Message: errorMessage(resp, msg)}
	}
	return resp, cancel, nil
}

// JSON performs the call and decodes a JSON answer into out (nil: discard).
func (c *Client) JSON(ctx context.Context, r Request, out any) error {
	resp, cancel, err := c.Do(ctx, r)
	if err != nil {
		return err
	}
	defer cancel()
	defer resp.Body.Close()
	if out == nil {
		_, _ = io.Copy(io.Discard, resp.Body)
		return nil
	}
	body, err := c.jsonBody(r, resp)
	if err != nil {
		return err
	}
	if err := json.NewDecoder(body).Decode(out); err != nil {
		return body.failed(r, "decode answer", err)
	}
	return nil
}

// Read performs the call and appends the JSON answer's bytes to buf, under
// the same checks and bound as JSON; for answers decoded by hand.
func (c *Client) Read(ctx context.Context, r Request, buf *bytes.Buffer) error {
	resp, cancel, err := c.Do(ctx, r)
	if err != nil {
		return err
	}
	defer cancel()
	defer resp.Body.Close()
	body, err := c.jsonBody(r, resp)
	if err != nil {
		return err
	}
	if n := resp.ContentLength; n > 0 && n <= MaxAnswer {
		buf.Grow(int(n))
	}
	if _, err := buf.ReadFrom(body); err != nil {
		return body.failed(r, "read answer", err)
	}
	return nil
}

// jsonBody refuses an answer that is not JSON and returns its body capped
// at MaxAnswer.
func (c *Client) jsonBody(r Request, resp *http.Response) (*capped, error) {
	if !IsJSON(resp) {
		return nil, fmt.Errorf("%s %s: expected a JSON answer, got %q: is %s a dstack agent?", r.Method, r.Path, resp.Header.Get("Content-Type"), c.BaseURL)
	}
	return &capped{r: resp.Body, left: MaxAnswer}, nil
}

// capped reads at most left bytes, then fails.
type capped struct {
	r    io.Reader
	left int64
	over bool
}

// failed is the call's error for err, met while doing what with the
// body: the refusal when the answer ran past the cap.
func (c *capped) failed(r Request, what string, err error) error {
	if c.over {
		return fmt.Errorf("%s %s: the answer is larger than %d bytes: refused", r.Method, r.Path, MaxAnswer)
	}
	return fmt.Errorf("%s %s: %s: %w", r.Method, r.Path, what, err)
}

func (c *capped) Read(p []byte) (int, error) {
	if c.left <= 0 {
		c.over = true
		return 0, errors.New("answer too large")
	}
	if int64(len(p)) > c.left {
		p = p[:c.left]
	}
	n, err := c.r.Read(p)
	c.left -= int64(n)
	return n, err
}

// errorMessage is what an error answer says, in one line: an agent's
// answers are JSON or plain text; anything else (a web server's HTML page)
// is named by its type, not dumped.
func errorMessage(resp *http.Response, body []byte) string {
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	switch {
	case mt == "application/json", mt == "text/plain", mt == "" && len(body) == 0:
		msg := strings.TrimSpace(string(body))
		if i := strings.IndexByte(msg, '\n'); i >= 0 && mt != "application/json" {
			msg = msg[:i] + " ..."
		}
		return msg
	}
	return fmt.Sprintf("a %s answer of %d bytes, not a dstack agent's", cmp.Or(mt, "untyped"), len(body))
}

// IsJSON reports whether the answer declares a JSON body.
func IsJSON(resp *http.Response) bool {
	mt, _, err := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	return err == nil && mt == "application/json"
}
