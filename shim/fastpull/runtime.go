package fastpull

import (
	"context"
	"io"

	"github.com/tandem-run/tandem/shim/task"
)

// Runtime is a task.Runtime whose pulls take the fast path first.
type Runtime struct {
	task.Runtime
	Puller *Puller
	// Forget, when set, is told each ref whose pull stream closed, so an
	// image check asks Docker afresh (dockerrt.Runtime.ForgetImage).
	Forget func(ref string)
}

// Pull is the fast path's stream, Docker's pull behind it.
func (r Runtime) Pull(ctx context.Context, ref string, auth task.RegistryAuth) (io.ReadCloser, error) {
	rc, err := r.Puller.Pull(ctx, ref, auth, r.Runtime.Pull)
	if err != nil || r.Forget == nil {
		return rc, err
	}
	return forgetOnClose{ReadCloser: rc, done: func() { r.Forget(ref) }}, nil
}

type forgetOnClose struct {
	io.ReadCloser
	done func()
}

func (f forgetOnClose) Close() error {
	err := f.ReadCloser.Close()
	f.done()
	return err
}
