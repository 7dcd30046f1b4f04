// Package portfwd publishes a bridge task's runner ports on the host's
// loopback itself, behind the same gate as the shim's API, instead of
// Docker publishing them. A port Docker publishes on 127.0.0.1 answers
// every local account and every host-network job, and the runner's API
// lets whoever reaches it read the job's output, stop it or submit first;
// here each connection is admitted (a root-equivalent account on the host,
// not a container) before a byte reaches the runner.
package portfwd

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/tandem-run/tandem/api"
)

// Admit decides one accepted connection: false with the message the
// client reads and the log line.
type Admit func(c net.Conn) (ok bool, msg string)

// Forwarder holds every task's forwarded ports.
type Forwarder struct {
	admit Admit
	log   *slog.Logger
	// MaxConns bounds a task's open connections (each holds two
	// descriptors and two goroutines).
	MaxConns int
	// DialTimeout bounds the connect to the container.
	DialTimeout time.Duration

	mu    sync.Mutex
	tasks map[string]*taskPorts
}

// New makes a forwarder whose connections pass admit.
func New(admit Admit, log *slog.Logger) *Forwarder {
	return &Forwarder{admit: admit, log: log, MaxConns: 256, DialTimeout: 5 * time.Second, tasks: map[string]*taskPorts{}}
}

type taskPorts struct {
	id     string
	lns    []net.Listener
	mu     sync.Mutex
	conns  map[net.Conn]net.Conn // client -> its connection to the container
	closed bool
	wg     sync.WaitGroup
}

// Open forwards the container's ports (at ip) from the host's 127.0.0.1:
// on the host ports in want where given (a restart re-opens what the
// server was told), else on ephemeral ones. It returns the mappings, as
// the shim reports them. A task already forwarded is closed first.
func (f *Forwarder) Open(taskID, ip string, ports []int, want []api.PortMapping) ([]api.PortMapping, error) {
	f.Close(taskID)
	tp := &taskPorts{id: taskID, conns: map[net.Conn]net.Conn{}}
	out := make([]api.PortMapping, 0, len(ports))
	for _, p := range ports {
		host := 0
		for _, w := range want {
			if w.Container == p {
				host = w.Host
			}
		}
		ln, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(host)))
		if err != nil {
			tp.close()
			return nil, fmt.Errorf("forward container port %d: %w", p, err)
		}
		tp.lns = append(tp.lns, ln)
		out = append(out, api.PortMapping{Host: ln.Addr().(*net.TCPAddr).Port, Container: p})
		target := net.JoinHostPort(ip, strconv.Itoa(p))
		tp.wg.Add(1)
		go f.serve(tp, ln, target)
	}
	f.mu.Lock()
	f.tasks[taskID] = tp
	f.mu.Unlock()
	f.log.Debug("ports forwarded", "task_id", taskID, "target", ip, "ports", out)
	return out, nil
}

// Close stops a task's listeners and its open connections; a task with
// none is a no-op.
func (f *Forwarder) Close(taskID string) {
	f.mu.Lock()
	tp := f.tasks[taskID]
	delete(f.tasks, taskID)
	f.mu.Unlock()
	if tp != nil {
		tp.close()
	}
}

// CloseAll stops every task's forwards (the shim's shutdown).
func (f *Forwarder) CloseAll() {
	f.mu.Lock()
	ids := make([]string, 0, len(f.tasks))
	for id := range f.tasks {
		ids = append(ids, id)
	}
	f.mu.Unlock()
	for _, id := range ids {
		f.Close(id)
	}
}

// Ports lists a task's forwarded host ports (tests, metrics).
func (f *Forwarder) Ports(taskID string) []int {
	f.mu.Lock()
	defer f.mu.Unlock()
	tp := f.tasks[taskID]
	if tp == nil {
		return nil
	}
	var out []int
	for _, ln := range tp.lns {
		out = append(out, ln.Addr().(*net.TCPAddr).Port)
	}
	slices.Sort(out)
	return out
}

func (tp *taskPorts) close() {
	tp.mu.Lock()
	tp.closed = true
	conns := make([]net.Conn, 0, 2*len(tp.conns))
	for c, up := range tp.conns {
		conns = append(conns, c)
		if up != nil {
			conns = append(conns, up)
		}
	}
	tp.mu.Unlock()
	for _, ln := range tp.lns {
		ln.Close()
	}
	for _, c := range conns {
		c.Close()
	}
	tp.wg.Wait()
}

// track registers c; false when the task is closed or at its bound.
func (tp *taskPorts) track(c net.Conn, max int) bool {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if tp.closed || len(tp.conns) >= max {
		return false
	}
	tp.conns[c] = nil
	return true
}

// attach records c's connection to the container; false when the task
// closed meanwhile.
func (tp *taskPorts) attach(c, up net.Conn) bool {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	if tp.closed {
		return false
	}
	tp.conns[c] = up
	return true
}

func (tp *taskPorts) untrack(c net.Conn) {
	tp.mu.Lock()
	delete(tp.conns, c)
	tp.mu.Unlock()
}

func (f *Forwarder) serve(tp *taskPorts, ln net.Listener, target string) {
	defer tp.wg.Done()
	for {
		c, err := ln.Accept()
		if err != nil {
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				continue
			}
			return
		}
		if !tp.track(c, f.MaxConns) {
			f.log.Warn("task port connection dropped: too many open", "task_id", tp.id, "peer", c.RemoteAddr().String(), "max", f.MaxConns)
			c.Close()
			continue
		}
		tp.wg.Add(1)
		go func() {
			defer tp.wg.Done()
			defer tp.untrack(c)
			f.handle(tp, c, target)
		}()
	}
}

func (f *Forwarder) handle(tp *taskPorts, c net.Conn, target string) {
	defer c.Close()
	if ok, msg := f.admit(c); !ok {
		f.log.Warn("task port connection refused", "task_id", tp.id, "port", c.LocalAddr().String(), "why", msg)
		refuse(c, msg)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), f.DialTimeout)
	var d net.Dialer
	up, err := d.DialContext(ctx, "tcp", target)
	cancel()
	if err != nil {
		f.log.Debug("task port: the container does not answer", "task_id", tp.id, "target", target, "err", err)
		return
	}
	defer up.Close()
	if !tp.attach(c, up) {
		return
	}
	done := make(chan struct{}, 2)
	pipe := func(dst, src net.Conn) {
		_, _ = io.Copy(dst, src)
		if tc, ok := dst.(*net.TCPConn); ok {
			_ = tc.CloseWrite()
		}
		done <- struct{}{}
	}
	go pipe(up, c)
	go pipe(c, up)
	<-done
	<-done
}

// refuse tells the client why, as an HTTP answer (the runner's API port is
// HTTP; an SSH client reads it as a banner line and gives up).
func refuse(c net.Conn, msg string) {
	_ = c.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
	_, _ = fmt.Fprintf(c, "HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%s", len(msg), msg)
	// Closing over unread request bytes would reset the connection and
	// lose the answer: half-close, then drain briefly.
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.CloseWrite()
	}
	_ = c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
	_, _ = io.CopyN(io.Discard, c, 64<<10)
}
