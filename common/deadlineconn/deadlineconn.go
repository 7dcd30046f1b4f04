// Package deadlineconn gives deadlines to connections that have none of
// their own (an SSH channel): a deadline that passes closes the connection,
// so a blocked Read or Write returns, as libraries that bound a handshake
// or a call with a deadline expect. What it cannot do is make a later call
// work again: a passed deadline ends the connection.
package deadlineconn

import (
	"net"
	"sync"
	"time"
)

// Wrap returns c with deadlines that close it when they pass.
func Wrap(c net.Conn) net.Conn { return &conn{Conn: c} }

type conn struct {
	net.Conn
	mu    sync.Mutex // guards timer
	timer *time.Timer
}

func (c *conn) SetDeadline(t time.Time) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.timer != nil {
		c.timer.Stop()
		c.timer = nil
	}
	if !t.IsZero() {
		c.timer = time.AfterFunc(time.Until(t), func() { c.Conn.Close() })
	}
	return nil
}

func (c *conn) SetReadDeadline(t time.Time) error  { return c.SetDeadline(t) }
func (c *conn) SetWriteDeadline(t time.Time) error { return c.SetDeadline(t) }
