package outbox

// ChannelName exposes channelName to the tests of package outbox_test.
var ChannelName = channelName
