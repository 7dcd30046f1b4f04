package sshd

import (
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"

	gssh "github.com/gliderlabs/ssh"
	gossh "golang.org/x/crypto/ssh"
)

// streamLocal implements OpenSSH's Unix-socket forwarding both ways
// (ssh -L/-R with socket paths); the dstack server reverse-forwards
// /run/dstack/server.sock this way.
type streamLocal struct {
	log *slog.Logger

	mu        sync.Mutex // guards listeners
	listeners map[string]net.Listener
}

type streamLocalDirect struct {
	SocketPath string
	Reserved0  string
	Reserved1  uint32
}

type streamLocalForward struct {
	SocketPath string
}

type forwardedStreamLocal struct {
	SocketPath string
	Reserved   string
}

func pipe(a, b io.ReadWriteCloser) {
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); _, _ = io.Copy(a, b); a.Close() }()
	go func() { defer wg.Done(); _, _ = io.Copy(b, a); b.Close() }()
	wg.Wait()
}

func (sl *streamLocal) direct(_ *gssh.Server, _ *gossh.ServerConn, nc gossh.NewChannel, _ gssh.Context) {
	var d streamLocalDirect
	if err := gossh.Unmarshal(nc.ExtraData(), &d); err != nil {
		_ = nc.Reject(gossh.ConnectionFailed, "malformed streamlocal request")
		return
	}
	conn, err := net.Dial("unix", d.SocketPath)
	acceptAndPipe(nc, conn, err)
}

// acceptAndPipe finishes a forward channel: reject it with the dial error,
// or accept it and copy both ways until either side ends.
func acceptAndPipe(nc gossh.NewChannel, conn net.Conn, dialErr error) {
	if dialErr != nil {
		_ = nc.Reject(gossh.ConnectionFailed, dialErr.Error())
		return
	}
	ch, reqs, err := nc.Accept()
	if err != nil {
		conn.Close()
		return
	}
	go gossh.DiscardRequests(reqs)
	pipe(ch, conn)
}

func (sl *streamLocal) forward(ctx gssh.Context, _ *gssh.Server, req *gossh.Request) (bool, []byte) {
	var f streamLocalForward
	if err := gossh.Unmarshal(req.Payload, &f); err != nil {
		return false, nil
	}
	conn, ok := ctx.Value(gssh.ContextKeyConn).(*gossh.ServerConn)
	if !ok {
		return false, nil
	}
	ln, err := net.Listen("unix", f.SocketPath)
	if err != nil {
		sl.log.Info("streamlocal forward refused", "path", f.SocketPath, "err", err)
		return false, nil
	}
	sl.mu.Lock()
	if sl.listeners == nil {
		sl.listeners = map[string]net.Listener{}
	}
	sl.listeners[f.SocketPath] = ln
	sl.mu.Unlock()
	go func() {
		<-ctx.Done()
		sl.close(f.SocketPath)
	}()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				payload := gossh.Marshal(forwardedStreamLocal{SocketPath: f.SocketPath})
				ch, reqs, err := conn.OpenChannel("forwarded-streamlocal@openssh.com", payload)
				if err != nil {
					c.Close()
					return
				}
				go gossh.DiscardRequests(reqs)
				pipe(ch, c)
			}()
		}
	}()
	return true, nil
}

func (sl *streamLocal) cancel(_ gssh.Context, _ *gssh.Server, req *gossh.Request) (bool, []byte) {
	var f streamLocalForward
	if err := gossh.Unmarshal(req.Payload, &f); err != nil {
		return false, nil
	}
	return sl.close(f.SocketPath), nil
}

func (sl *streamLocal) close(path string) bool {
	sl.mu.Lock()
	ln, ok := sl.listeners[path]
	delete(sl.listeners, path)
	sl.mu.Unlock()
	if ok {
		ln.Close()
		_ = os.Remove(path)
	}
	return ok
}

type directTCPIPData struct {
	DestAddr   string
	DestPort   uint32
	OriginAddr string
	OriginPort uint32
}

// directTCPIP serves ssh -L to a TCP address. Unlike gliderlabs' handler it
// returns only when the forward ends, so per-connection channel accounting
// holds for forwards too.
func directTCPIP(_ *gssh.Server, _ *gossh.ServerConn, nc gossh.NewChannel, ctx gssh.Context) {
	var d directTCPIPData
	if err := gossh.Unmarshal(nc.ExtraData(), &d); err != nil {
		_ = nc.Reject(gossh.ConnectionFailed, "malformed direct-tcpip request")
		return
	}
	var dialer net.Dialer
	conn, err := dialer.DialContext(ctx, "tcp", net.JoinHostPort(d.DestAddr, strconv.Itoa(int(d.DestPort))))
	acceptAndPipe(nc, conn, err)
}
