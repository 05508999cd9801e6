package exactlyonce

import (
	"errors"

	"github.com/ThreeDotsLabs/watermill"
)

// RouterLogger wraps the logger given to watermill.NewRouter so that a
// delivery the middleware already reported is not logged again by the
// router at ERROR level for every redelivery. The middleware logs a
// failure that repeats (the database or the lease store unavailable, the
// tables not migrated, failing claims, a store-only configuration error)
// as an episode: a line when it starts, one every 30 seconds while it goes
// on, with counts, and one when it ends. A lease held by another worker is
// expected contention, logged at debug level. The router's line for each
// such delivery ("Handler returned error") goes to logger at debug level
// instead; every other error (your handler's own, a panic, a publish that
// failed) is logged as before.
//
//	logger := watermill.NewSlogLogger(nil)
//	router, err := message.NewRouter(message.RouterConfig{}, exactlyonce.RouterLogger(logger))
//	eo, err := exactlyonce.New(exactlyonce.Config{DB: db, Logger: logger})
func RouterLogger(logger watermill.LoggerAdapter) watermill.LoggerAdapter {
	return routerLogger{logger}
}

type routerLogger struct{ watermill.LoggerAdapter }

func (l routerLogger) Error(msg string, err error, fields watermill.LogFields) {
	if wasReported(err) {
		l.Debug(msg, fields.Add(watermill.LogFields{"err": err, "reported_by": "exactlyonce"}))
		return
	}
	l.LoggerAdapter.Error(msg, err, fields)
}

func (l routerLogger) With(fields watermill.LogFields) watermill.LoggerAdapter {
	return routerLogger{l.LoggerAdapter.With(fields)}
}

// wasReported reports whether err is, or wraps along a single chain, an
// error the middleware reported. A joined error (a poison queue's publish
// that failed too, for example) is not: one of its parts may be news.
func wasReported(err error) bool {
	for err != nil {
		if _, ok := err.(reportedError); ok { //nolint:errorlint // the loop walks the single Unwrap chain itself: errors.As would also search joined errors
			return true
		}
		err = errors.Unwrap(err) // nil for a joined error
	}
	return false
}
