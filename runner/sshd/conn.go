package sshd

import (
	"sync"
	"sync/atomic"

	gssh "github.com/gliderlabs/ssh"

	"github.com/tandem-run/tandem/runner/account"
)

// connection is one SSH connection's state, kept under one key of the
// connection's context: every handler of the connection (auth, sessions,
// forwards, channels) finds the same value.
type connection struct {
	mu sync.Mutex // guards the fields below but channels
	// login is the connection's user, resolved once by Server.login
	// (loginDone) and reused for every key tried, session and forward.
	login     account.Login
	loginErr  error
	loginDone bool
	// grants is what each authorized key line grants, by key fingerprint;
	// set during auth (the first line that admits a key wins) and read by
	// grant.
	grants map[string]keyOptions
	// probing is set when the first channel started keep-alive probes.
	probing bool

	channels atomic.Int64 // channels open now (Server.channel)
}

type connStateKey struct{}

// connOf returns ctx's connection state, made on first use.
func connOf(ctx gssh.Context) *connection {
	ctx.Lock()
	defer ctx.Unlock()
	c, ok := ctx.Value(connStateKey{}).(*connection)
	if !ok {
		c = &connection{grants: map[string]keyOptions{}}
		ctx.SetValue(connStateKey{}, c)
	}
	return c
}
