package transport

import (
	"context"
	"errors"
	"net"
)

// IsTimeout reports whether err is a call that ran out of time.
func IsTimeout(err error) bool {
	var ne net.Error
	return errors.Is(err, context.DeadlineExceeded) || (errors.As(err, &ne) && ne.Timeout())
}
