"""The front end's actors, in every API-server process: admission, the engine client,
output processing (detokenizing, stop strings, logprob text) and the streams the routes
read. No torch; it never imports the engine core."""
