package sshd

import (
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync"
	"syscall"

	gssh "github.com/gliderlabs/ssh"
	gossh "golang.org/x/crypto/ssh"
)

// forwards serves -L and -R for TCP ports and Unix sockets (OpenSSH's
// direct-tcpip, tcpip-forward, and the streamlocal extensions the dstack
// server uses for /run/dstack/server.sock). Every socket is opened as the
// login user (dialAs, listenAs), within what the key's options allow;
// -R listens on loopback unless GatewayPorts, and only root may listen on
// ports below 1024.
type forwards struct {
	s   *Server
	log *slog.Logger
	cp  *copier

	mu     sync.Mutex        // guards closes
	closes map[string]func() // how to end each -R listener, by connKey
}

type directTCPIPData struct {
	DestAddr   string
	DestPort   uint32
	OriginAddr string
	OriginPort uint32
}

type tcpForwardReq struct {
	BindAddr string
	BindPort uint32
}

type tcpForwardReply struct {
	Port uint32
}

type forwardedTCPPayload struct {
	Addr       string
	Port       uint32
	OriginAddr string
	OriginPort uint32
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

// acceptAndPipe finishes a forward channel: reject it with the dial error,
// or accept it and copy both ways until either side ends.
func (f *forwards) acceptAndPipe(nc gossh.NewChannel, conn net.Conn, dialErr error) {
	if dialErr != nil {
		f.log.Info("ssh forward: connect failed", "err", dialErr)
		_ = nc.Reject(gossh.ConnectionFailed, connectFailure(dialErr))
		return
	}
	ch, reqs, err := nc.Accept()
	if err != nil {
		conn.Close()
		return
	}
	f.cp.forward(ch, reqs, conn)
}

func (f *forwards) refuse(ctx gssh.Context, what, why string) {
	f.log.Info("ssh forward refused", "user", ctx.User(), "remote", ctx.RemoteAddr().String(), "forward", what, "why", why)
}

// directTCP serves ssh -L to a TCP address. It returns only when the
// forward ends, so per-connection channel accounting holds for forwards.
func (f *forwards) directTCP(_ *gssh.Server, _ *gossh.ServerConn, nc gossh.NewChannel, ctx gssh.Context) {
	var d directTCPIPData
	if err := gossh.Unmarshal(nc.ExtraData(), &d); err != nil {
		_ = nc.Reject(gossh.ConnectionFailed, "malformed direct-tcpip request")
		return
	}
	dest := net.JoinHostPort(d.DestAddr, strconv.Itoa(int(d.DestPort)))
	if !f.s.grant(ctx).permitsOpen(d.DestAddr, d.DestPort) {
		f.refuse(ctx, "-L "+dest, "not permitted by the key's options")
		_ = nc.Reject(gossh.Prohibited, "port forwarding to "+dest+" is not permitted")
		return
	}
	login, err := f.s.login(ctx)
	if err != nil {
		f.refuse(ctx, "a forward", err.Error())
		_ = nc.Reject(gossh.ConnectionFailed, "the account cannot be used (the runner's log has the cause)")
		return
	}
	conn, err := f.s.dialAs(ctx, login, "tcp", dest)
	f.acceptAndPipe(nc, conn, err)
}

// directUnix serves ssh -L to a Unix socket, connecting as the user.
func (f *forwards) directUnix(_ *gssh.Server, _ *gossh.ServerConn, nc gossh.NewChannel, ctx gssh.Context) {
	var d streamLocalDirect
	if err := gossh.Unmarshal(nc.ExtraData(), &d); err != nil {
		_ = nc.Reject(gossh.ConnectionFailed, "malformed streamlocal request")
		return
	}
	if f.s.grant(ctx).noPortForwarding {
		f.refuse(ctx, "-L "+d.SocketPath, "no-port-forwarding")
		_ = nc.Reject(gossh.Prohibited, "port forwarding is not permitted")
		return
	}
	login, err := f.s.login(ctx)
	if err != nil {
		f.refuse(ctx, "a forward", err.Error())
		_ = nc.Reject(gossh.ConnectionFailed, "the account cannot be used (the runner's log has the cause)")
		return
	}
	conn, err := f.s.dialAs(ctx, login, "unix", d.SocketPath)
	f.acceptAndPipe(nc, conn, err)
}

// bindAddr is where a -R TCP listen really binds.
func (f *forwards) bindAddr(requested string) string {
	if f.s.cfg.GatewayPorts {
		switch requested {
		case "", "*":
			return ""
		case "localhost":
			return "127.0.0.1"
		}
		return requested
	}
	if ip := net.ParseIP(requested); ip != nil && ip.IsLoopback() {
		return requested
	}
	return "127.0.0.1"
}

func connKey(ctx gssh.Context, kind, addr string) string {
	return fmt.Sprintf("%s|%s|%s", ctx.SessionID(), kind, addr)
}

func (f *forwards) keep(ctx gssh.Context, key string, closeIt func()) {
	f.mu.Lock()
	if f.closes == nil {
		f.closes = map[string]func(){}
	}
	prev := f.closes[key]
	f.closes[key] = closeIt
	f.mu.Unlock()
	if prev != nil {
		prev() // never lose a listener: one key, one listener
	}
	go func() {
		<-ctx.Done()
		f.end(key)
	}()
}

// end closes the -R listener under key, once: on cancel or when the
// connection ends, whichever comes first.
func (f *forwards) end(key string) bool {
	f.mu.Lock()
	closeIt, ok := f.closes[key]
	delete(f.closes, key)
	f.mu.Unlock()
	if ok {
		closeIt()
	}
	return ok
}

// listenTCP serves ssh -R for a TCP port.
func (f *forwards) listenTCP(ctx gssh.Context, _ *gssh.Server, req *gossh.Request) (bool, []byte) {
	var r tcpForwardReq
	if err := gossh.Unmarshal(req.Payload, &r); err != nil || r.BindPort > 65535 {
		return false, nil
	}
	what := "-R " + net.JoinHostPort(r.BindAddr, strconv.Itoa(int(r.BindPort)))
	conn, ok := ctx.Value(gssh.ContextKeyConn).(*gossh.ServerConn)
	if !ok {
		return false, nil
	}
	if !f.s.grant(ctx).permitsListen(r.BindAddr, r.BindPort) {
		f.refuse(ctx, what, "not permitted by the key's options")
		return false, nil
	}
	login, err := f.s.login(ctx)
	if err != nil {
		return false, nil
	}
	if r.BindPort != 0 && r.BindPort < 1024 && login.UID != 0 {
		f.refuse(ctx, what, "only root may listen on ports below 1024")
		return false, nil
	}
	ln, err := f.s.listenAs(ctx, login, "tcp", net.JoinHostPort(f.bindAddr(r.BindAddr), strconv.Itoa(int(r.BindPort))))
	if err != nil {
		f.refuse(ctx, what, err.Error())
		return false, nil
	}
	port := uint32(ln.Addr().(*net.TCPAddr).Port)
	// Keyed by the port it really has: two -R 0 on one connection are two
	// listeners (OpenSSH cancels with the allocated port).
	key := connKey(ctx, "tcp", net.JoinHostPort(r.BindAddr, strconv.Itoa(int(port))))
	f.keep(ctx, key, func() { ln.Close() })
	go f.serveForward(ln, conn, "forwarded-tcpip", func(c net.Conn) []byte {
		oaddr, oport := "", 0
		if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
			oaddr, oport = ta.IP.String(), ta.Port
		}
		return gossh.Marshal(forwardedTCPPayload{Addr: r.BindAddr, Port: port, OriginAddr: oaddr, OriginPort: uint32(oport)})
	})
	return true, gossh.Marshal(tcpForwardReply{Port: port})
}

func (f *forwards) cancelTCP(ctx gssh.Context, _ *gssh.Server, req *gossh.Request) (bool, []byte) {
	var r tcpForwardReq
	if err := gossh.Unmarshal(req.Payload, &r); err != nil {
		return false, nil
	}
	return f.end(connKey(ctx, "tcp", net.JoinHostPort(r.BindAddr, strconv.Itoa(int(r.BindPort))))), nil
}

// listenUnix serves ssh -R for a Unix socket, created by the user.
func (f *forwards) listenUnix(ctx gssh.Context, _ *gssh.Server, req *gossh.Request) (bool, []byte) {
	var r streamLocalForward
	if err := gossh.Unmarshal(req.Payload, &r); err != nil {
		return false, nil
	}
	conn, ok := ctx.Value(gssh.ContextKeyConn).(*gossh.ServerConn)
	if !ok {
		return false, nil
	}
	if f.s.grant(ctx).noPortForwarding {
		f.refuse(ctx, "-R "+r.SocketPath, "no-port-forwarding")
		return false, nil
	}
	login, err := f.s.login(ctx)
	if err != nil {
		return false, nil
	}
	ln, err := f.s.listenAs(ctx, login, "unix", r.SocketPath)
	if err != nil {
		f.refuse(ctx, "-R "+r.SocketPath, err.Error())
		return false, nil
	}
	if ul, ok := ln.(*net.UnixListener); ok {
		ul.SetUnlinkOnClose(false) // removed below, only if still ours
	}
	key := connKey(ctx, "unix", r.SocketPath)
	owner := login.UID
	if !f.s.needsHelper(login) {
		owner = os.Geteuid()
	}
	f.keep(ctx, key, func() {
		ln.Close()
		removeSocket(r.SocketPath, owner)
	})
	go f.serveForward(ln, conn, "forwarded-streamlocal@openssh.com", func(net.Conn) []byte {
		return gossh.Marshal(forwardedStreamLocal{SocketPath: r.SocketPath})
	})
	return true, nil
}

func (f *forwards) cancelUnix(ctx gssh.Context, _ *gssh.Server, req *gossh.Request) (bool, []byte) {
	var r streamLocalForward
	if err := gossh.Unmarshal(req.Payload, &r); err != nil {
		return false, nil
	}
	// The same close as at the end of the connection: the socket is
	// unlinked only while it is still the one the user created.
	return f.end(connKey(ctx, "unix", r.SocketPath)), nil
}

// serveForward accepts on a -R listener until it closes and carries each
// connection over a new channel of kind to the client.
func (f *forwards) serveForward(ln net.Listener, conn *gossh.ServerConn, kind string, payload func(net.Conn) []byte) {
	for {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		go func() {
			ch, reqs, err := conn.OpenChannel(kind, payload(c))
			if err != nil {
				c.Close()
				return
			}
			f.cp.forward(ch, reqs, c)
		}()
	}
}

// removeSocket unlinks path only while it is still a socket owned by uid:
// the name may have been replaced since.
func removeSocket(path string, uid int) {
	fi, err := os.Lstat(path)
	if err != nil || fi.Mode()&os.ModeSocket == 0 {
		return
	}
	if st, ok := fi.Sys().(*syscall.Stat_t); ok && int(st.Uid) == uid {
		_ = os.Remove(path)
	}
}
